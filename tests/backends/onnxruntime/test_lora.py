"""LoRA adapters as run-time data on ONNX Runtime (CPU): the tiny Llama compiled with enable_lora against
the reference executable of the same program — a ragged batch mixing slots 0, 1, 2 and -1 over two steps,
a step given no LoRA inputs (every row on the base model, the empty tables bound), each sequence alone as
in the batch; the tables are model inputs with dims LS and LR, the manifest says which."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.backends.base import CompileSettings, Executable
from kiln.backends.lora_tables import LoRASpec
from kiln.backends.onnx import META_FILE, read_lowered
from kiln.backends.onnxruntime.backend import OnnxRuntimeBackend
from kiln.backends.reference import ReferenceExecutable
from kiln.backends.targets import Target
from kiln.ir import StepInputs
from kiln.ir.step import (
    LORA_A_PREFIX,
    LORA_B_PREFIX,
    LORA_SLOTS_INPUT,
    SequenceSlice,
    StepSignature,
    build_step_inputs,
)

TOLERANCE = 1e-4  # max |ours - reference| / max |reference|
ALONE_TOLERANCE = 1e-5  # a sequence alone against its rows in the batch
BLOCK_SIZE = 16
SLOTS, RANK = 3, 4
# (tokens in step 1, in step 2, LoRA slot, block table): prefills then a decode, a chunk, a fresh prefill
SEQUENCES = [(20, 1, 0, [3, 7]), (10, 9, 1, [2, 8]), (0, 7, 2, [5]), (12, 1, -1, [1, 9])]
CACHE_BLOCKS = 10


@pytest.fixture(scope="module")
def compiled(tiny_llama, tmp_path_factory: pytest.TempPathFactory):
    """(folder, ONNX Runtime executable, reference executable) of the tiny Llama with LoRA."""
    from kiln.compiler.build import optimize
    from kiln.compiler.options import PipelineOptions

    config, weights = tiny_llama
    program = optimize(config, weights, PipelineOptions(enable_lora=True)).program
    assert "lora" in {node.op for node in program.graph.nodes}
    folder = tmp_path_factory.mktemp("ort-lora")
    backend = OnnxRuntimeBackend()
    code = backend.compile(program, Target("cpu"), folder, CompileSettings(num_threads=2))
    assert code.kernels["lora"].startswith("onnx Gemm, Where")
    ours = backend.load(folder, program.weights, Target("cpu"))
    return folder, ours, ReferenceExecutable(program.graph, program.weights)


def _tables(spec: LoRASpec) -> dict[str, np.ndarray]:
    tables = spec.allocate(SLOTS, RANK)
    generator = np.random.default_rng(0)
    for table in tables.values():
        table[...] = generator.standard_normal(table.shape).astype(table.dtype) * 0.1
    return tables


def _steps(which: list[int], tables: dict[str, np.ndarray] | None) -> list[StepInputs]:
    """The steps of the sequences `which` (indices into SEQUENCES; a step without any of their tokens is
    left out), with `tables` or no LoRA inputs."""
    generator = torch.Generator().manual_seed(7)
    tokens = [
        torch.randint(2, 64, (first + second,), generator=generator).tolist()
        for first, second, *_ in SEQUENCES
    ]
    steps = []
    for step in (0, 1):
        slices = []
        for index in which:
            first, _, slot, blocks = SEQUENCES[index]
            chunk = tokens[index][:first] if step == 0 else tokens[index][first:]
            if chunk:
                slices.append(SequenceSlice(chunk, 0 if step == 0 else first, blocks, lora_slot=slot))
        if not slices:
            continue
        inputs = build_step_inputs(slices, BLOCK_SIZE, lora=tables is not None)
        steps.append(inputs.with_optional(tables or {}))
    return steps


def _spec(executable: Executable) -> LoRASpec:
    spec = LoRASpec.of_signature(executable.signature)
    assert spec is not None
    return spec


def _run(executable, steps: list[StepInputs]) -> tuple[list[np.ndarray], torch.Tensor]:
    cache = executable.kv_cache_spec.allocate(CACHE_BLOCKS, BLOCK_SIZE)
    return [executable.step(inputs, cache) for inputs in steps], cache


def _relative_error(ours: np.ndarray | torch.Tensor, theirs: np.ndarray | torch.Tensor) -> float:
    ours, theirs = (torch.as_tensor(np.asarray(x)).float() for x in (ours, theirs))
    return float((ours - theirs).abs().max() / theirs.abs().max())


def test_the_manifest_and_the_model_inputs_carry_the_tables(compiled) -> None:
    folder, ours, _ = compiled
    meta = json.loads((Path(folder) / META_FILE).read_text())
    spec = LoRASpec.of_signature(ours.signature)
    assert LoRASpec.of_signature(StepSignature.from_fields(meta["signature"])) == spec
    assert spec is not None and {m.name for m in spec.modules} >= {"q_proj", "v_proj", "down_proj"}
    model, _ = read_lowered(Path(folder))
    inputs = {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input
    }
    assert inputs[LORA_SLOTS_INPUT] == ["T"]
    assert inputs[LORA_A_PREFIX + "q_proj"] == [2, "LS", "LR", 32]
    assert inputs[LORA_B_PREFIX + "k_proj"] == [2, "LS", "LR", 16]


def test_mixed_slots_match_the_reference(compiled) -> None:
    _, ours, reference = compiled
    steps = _steps(list(range(len(SEQUENCES))), _tables(_spec(ours)))
    (first, second), cache = _run(ours, steps)
    (ref_first, ref_second), ref_cache = _run(reference, steps)
    assert second.shape == ref_second.shape and second.shape[0] == 4
    assert max(_relative_error(first, ref_first), _relative_error(second, ref_second)) < TOLERANCE
    assert _relative_error(cache, ref_cache) < TOLERANCE
    # the adapters matter: the same rows on the base model differ, but for the sequence of slot -1's
    _, base_second = _run(ours, _steps(list(range(len(SEQUENCES))), None))[0]
    changed = np.abs(second - base_second).max(axis=1)
    assert (changed[:3] > 1e-3).all()
    assert np.array_equal(second[3], base_second[3])  # slot -1: y + 0.0, exactly the base model


def test_a_step_without_lora_inputs_runs_on_the_base_model(compiled) -> None:
    _, ours, reference = compiled
    steps = _steps(list(range(len(SEQUENCES))), None)
    assert steps[0].lora_slots is None and not steps[0].lora_tables
    ours_logits, _ = _run(ours, steps)
    ref_logits, _ = _run(reference, steps)
    for got, expected in zip(ours_logits, ref_logits, strict=True):
        assert _relative_error(got, expected) < TOLERANCE
    # the same as tables given and every row at slot -1
    all_base = [
        s.with_optional({LORA_SLOTS_INPUT: np.full_like(s.token_ids, -1), **_tables(_spec(ours))})
        for s in steps
    ]
    for got, expected in zip(_run(ours, all_base)[0], ours_logits, strict=True):
        assert np.array_equal(got, expected)


def test_each_sequence_alone_equals_its_rows_in_the_batch(compiled) -> None:
    _, ours, _ = compiled
    tables = _tables(_spec(ours))
    (_, batch_second), _ = _run(ours, _steps(list(range(len(SEQUENCES))), tables))
    for index in range(len(SEQUENCES)):
        (*_, alone_second), _ = _run(ours, _steps([index], tables))
        assert alone_second.shape == (1, batch_second.shape[1])
        assert _relative_error(alone_second[0], batch_second[index]) < ALONE_TOLERANCE
