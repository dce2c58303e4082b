"""ONNX Runtime (CPU) logits against the reference backend on tiny random HF models: float32 at O0
and O2, int4 (MatMulNBits + the group-sum term for its float zero points), int8 (dequantized at
load, Gemm) and a GGUF Q4_1
layout (scale * q + min, "gguf" nibble order) — on a ragged batch of 3 sequences mixing decode, a
fresh prefill and a chunked prefill over non-contiguous blocks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.backends.base import CompileSettings
from kiln.backends.onnxruntime.backend import OnnxRuntimeBackend
from kiln.backends.reference import ReferenceExecutable
from kiln.backends.targets import Target
from kiln.ir import Graph, Program
from kiln.ir.deferred import materialize
from kiln.ir.host_arrays import as_torch
from kiln.ir.ops.moe import quantized_inputs
from kiln.ir.ops.quant import pack_int4, unpack_int4
from kiln.passes import PassManager, PassOptions, pipeline

FLOAT_TOLERANCE = 1e-4  # max |ours - reference| / max |reference|
# MatMulNBits dequantizes in its own order (and Q4_1's min becomes a float zero point -min / scale):
# measured 1e-6 .. 3e-6 here, 1.1e-6 on SmolLM2 Q4_1 and int4.
QUANT_TOLERANCE = 1e-4
MOE_KINDS = ("mixtral", "olmoe", "qwen3_moe")  # quantized_moe: experts dequantized at load


def _as_gguf_q4_1(program: Program) -> Program:
    """The int4 program rewritten to GGUF Q4_1's layout: scale * q + min, "gguf" nibble order, f16
    scales and mins (the weights then stand for a slightly different model; both backends run it)."""
    weights = dict(program.weights)
    params = {}
    for param in program.graph.params:
        if param.name.endswith((".scales", ".zeros")):
            param = dataclasses.replace(param, type=dataclasses.replace(param.type, dtype="f16"))
        params[param.name] = param
    q4_1 = {"scheme": "min", "packing": "gguf"}

    def rewrite(qweight: str, scales: str, zeros: str) -> None:
        packed, scale, zero = (materialize(weights[name]) for name in (qweight, scales, zeros))
        rows = unpack_int4(packed.reshape(-1, packed.shape[-1]), "pairs")  # stacked experts: [E * N, K/2]
        weights[qweight] = pack_int4(rows, "gguf").reshape(packed.shape)
        weights[zeros] = (-zero * scale).to(torch.float16)
        weights[scales] = scale.to(torch.float16)

    nodes = []
    for node in program.graph.nodes:
        inputs = tuple(params.get(v.name, v) if v is not None else None for v in node.inputs)
        if node.op == "quantized_linear":
            rewrite(*(v.name for v in node.inputs[1:4]))  # type: ignore[union-attr]
            node = dataclasses.replace(node, attrs={**node.attrs, **q4_1})
        if node.op == "quantized_moe":
            attrs = dict(node.attrs)
            for name, parts in quantized_inputs(node.inputs).items():
                rewrite(*(v.name for v in parts))  # type: ignore[union-attr]
                attrs[name] = {**attrs[name], **q4_1}  # type: ignore[dict-item]
            node = dataclasses.replace(node, attrs=attrs)
        nodes.append(dataclasses.replace(node, inputs=inputs))
    graph = Graph(
        program.graph.name, program.graph.inputs, list(params.values()), nodes, program.graph.outputs
    )
    rewritten = Program(graph, weights)
    rewritten.verify()
    return rewritten


def _relative_error(ours: torch.Tensor | np.ndarray, theirs: torch.Tensor | np.ndarray) -> float:
    ours, theirs = (as_torch(x).float() if isinstance(x, np.ndarray) else x.float() for x in (ours, theirs))
    return float((ours - theirs).abs().max() / theirs.abs().max())


def _compare(program: Program, folder: Path, tolerance: float, ragged_run) -> dict[str, str]:
    backend = OnnxRuntimeBackend()
    code = backend.compile(program, Target("cpu"), folder, CompileSettings(num_threads=2))
    ours = backend.load(folder, program.weights, Target("cpu"))
    reference = ReferenceExecutable(program.graph, program.weights)
    (first, second, cache), (ref_first, ref_second, ref_cache) = ragged_run([ours, reference], 1234)
    assert second.shape == (3, 256) and second.dtype == torch.float32
    worst = max(_relative_error(first, ref_first), _relative_error(second, ref_second))
    assert worst < tolerance
    assert _relative_error(cache, ref_cache) < tolerance  # the K/V written in place
    return code.kernels


def test_float32_ragged_batch_matches_the_reference(
    tiny_kind: str, tmp_path: Path, make_tiny_program, ragged_run
) -> None:
    program = make_tiny_program(tiny_kind, tmp_path / "hf")
    _compare(program, tmp_path / "o0", FLOAT_TOLERANCE, ragged_run)
    optimized, _ = PassManager(pipeline(2, PassOptions())).run(program)
    _compare(optimized, tmp_path / "o2", FLOAT_TOLERANCE, ragged_run)


def _quantized(kind: str, quantization: str, folder: Path, make_tiny_program) -> Program:
    program = make_tiny_program(kind, folder)
    scheme = "int4" if quantization == "q4_1" else quantization
    options = PassOptions(quantization=scheme, quantize_lm_head=True)
    quantized, _ = PassManager(pipeline(2, options)).run(program, options)
    return _as_gguf_q4_1(quantized) if quantization == "q4_1" else quantized


@pytest.mark.parametrize("quantization", ["int4", "int8", "q4_1"])
def test_quantized_ragged_batch_matches_the_reference(
    quantization: str, tmp_path: Path, make_tiny_program, ragged_run
) -> None:
    # qwen2 has biases: the MatMulNBits + Add path
    quantized = _quantized("qwen2", quantization, tmp_path / "hf", make_tiny_program)
    kernels = _compare(quantized, tmp_path / "ort", QUANT_TOLERANCE, ragged_run)
    expected = (
        "onnx Gemm (weight dequantized at load)" if quantization == "int8" else "com.microsoft.MatMulNBits"
    )
    assert kernels["quantized_linear"].startswith(expected)


@pytest.mark.parametrize("quantization", ["int4", "int8", "q4_1"])
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_quantized_moe_ragged_batch_matches_the_reference(
    kind: str, quantization: str, tmp_path: Path, make_tiny_program, ragged_run
) -> None:
    quantized = _quantized(kind, quantization, tmp_path / "hf", make_tiny_program)
    assert "moe" not in {node.op for node in quantized.graph.nodes}
    kernels = _compare(quantized, tmp_path / "ort", QUANT_TOLERANCE, ragged_run)
    assert kernels["quantized_moe"].endswith("(experts dequantized at load)")
