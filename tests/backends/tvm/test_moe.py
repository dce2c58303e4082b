"""Mixture of experts on TVM-CPU: quantized experts (int8, int4, GGUF blocks) against the reference on
the ragged batch and a decode step, and decode reads only the chosen experts (the others poisoned
with NaN change nothing). Float experts are in test_cpu.py's tiny-model test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.backends.reference import ReferenceExecutable
from kiln.backends.tvm.cpu_features import host_flags
from kiln.ir import Program
from kiln.ir.deferred import materialize
from kiln.ir.ops import moe as moe_ops
from kiln.ir.step import SequenceSlice, build_step_inputs
from kiln.passes import PassManager, PassOptions, pipeline

BLOCK_SIZE = 16
TOLERANCE = 1e-4
QUANTIZED_TOLERANCE = 1e-3  # integer dot products over 16-bit quantized activations (int_dot.py)

needs_avx2 = pytest.mark.skipif(
    "avx2" not in host_flags(), reason="this CPU lacks AVX2: quantized experts have no TVM kernel here"
)


def _relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def _quantized(program: Program, quantization: str) -> Program:
    options = PassOptions(quantization=quantization)
    return PassManager(pipeline(2, options)).run(program, options)[0]


@needs_avx2
@pytest.mark.slow
# each family's routing once and each width at least once: the expert kernels do not depend on routing
@pytest.mark.parametrize("kind,quantization", [("mixtral", "int4"), ("qwen3_moe", "int8"), ("olmoe", "int4")])
def test_quantized_experts_match_the_reference(
    kind: str, quantization: str, tmp_path: Path, tvm_compile, make_tiny_program, ragged_run
) -> None:
    program = _quantized(make_tiny_program(kind, tmp_path / "hf", opt_level=0), quantization)
    assert program.graph.op_counts()["quantized_moe"] >= 1
    tvm = tvm_compile(program, tmp_path / "tvm")
    reference = ReferenceExecutable(program.graph, program.weights)
    ours, theirs = ragged_run([tvm, reference], 5)
    for step in range(2):
        assert _relative_error(ours[step], theirs[step]) < QUANTIZED_TOLERANCE, (kind, step)
    decode = build_step_inputs([SequenceSlice([7], 20, [3, 7])], BLOCK_SIZE)
    assert (
        _relative_error(
            torch.from_numpy(tvm.step(decode, ours[2])), torch.from_numpy(reference.step(decode, theirs[2]))
        )
        < QUANTIZED_TOLERANCE
    )


def _chosen_experts(reference: ReferenceExecutable, step, cache, monkeypatch) -> list[set[int]]:
    """The experts each moe node (in graph order) routes the step's tokens to, as the reference runs."""
    chosen: list[set[int]] = []
    route = moe_ops.route

    def recording(router_logits: torch.Tensor, **attrs) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = route(router_logits, **attrs)
        chosen.append(set(experts.flatten().tolist()))
        return weights, experts

    monkeypatch.setattr(moe_ops, "route", recording)
    reference.step(step, cache)
    monkeypatch.setattr(moe_ops, "route", route)
    return chosen


def _poisoned(program: Program, chosen: list[set[int]]) -> Program:
    """The program with every expert a moe node did not choose set to NaN (float weights, or the
    quantized ones' scales)."""
    weights = dict(program.weights)
    nodes = [n for n in program.graph.nodes if n.op in ("moe", "quantized_moe")]
    for node, experts in zip(nodes, chosen, strict=True):
        stacked = node.inputs[2:5] if node.op == "moe" else node.inputs[5:8]
        for value in stacked:
            assert value is not None
            tensor = materialize(weights[value.name]).clone()
            unchosen = [e for e in range(tensor.shape[0]) if e not in experts]
            tensor[unchosen] = float("nan")
            weights[value.name] = tensor
    return Program(program.graph, weights)


@needs_avx2
@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_decode_reads_only_the_chosen_experts(
    quantization: str | None, tmp_path: Path, tvm_compile, make_tiny_program, monkeypatch
) -> None:
    program = make_tiny_program("qwen3_moe", tmp_path / "hf", opt_level=2)  # 8 experts, top 2
    if quantization is not None:
        program = _quantized(program, quantization)
    reference = ReferenceExecutable(program.graph, program.weights)
    token = build_step_inputs([SequenceSlice([42], 0, [1])], BLOCK_SIZE)
    cache = reference.kv_cache_spec.allocate(2, BLOCK_SIZE)
    chosen = _chosen_experts(reference, token, cache, monkeypatch)
    assert chosen and all(len(experts) == 2 for experts in chosen)
    expected = torch.from_numpy(reference.step(token, reference.kv_cache_spec.allocate(2, BLOCK_SIZE)))
    tvm = tvm_compile(_poisoned(program, chosen), tmp_path / "tvm")
    logits = torch.from_numpy(tvm.step(token, tvm.kv_cache_spec.allocate(2, BLOCK_SIZE)))
    assert torch.isfinite(logits).all()
    tolerance = TOLERANCE if quantization is None else QUANTIZED_TOLERANCE
    assert _relative_error(logits, expected) < tolerance
