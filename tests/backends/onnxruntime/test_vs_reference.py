"""ONNX Runtime (CPU) logits against the reference backend on tiny random HF models: float32 at O0
and O2, int4 (MatMulNBits + the group-sum term for its float zero points), int8 (dequantized at
load, Gemm) and a GGUF Q4_1
layout (scale * q + min, "gguf" nibble order) — on a ragged batch of 3 sequences mixing decode, a
fresh prefill and a chunked prefill over non-contiguous blocks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models

from kiln.backends.base import CompileSettings, Executable
from kiln.backends.onnxruntime.backend import OnnxRuntimeBackend
from kiln.backends.reference import ReferenceExecutable
from kiln.backends.targets import Target
from kiln.frontend.capture import capture_weights
from kiln.frontend.load import load_model
from kiln.ir import Graph, Program
from kiln.ir.ops.quant import pack_int4, unpack_int4
from kiln.passes import PassManager, PassOptions, pipeline
from kiln.runtime.step_builder import SequenceSlice, build_step_inputs

BLOCK_SIZE = 16
FLOAT_TOLERANCE = 1e-4  # max |ours - reference| / max |reference|
# MatMulNBits dequantizes in its own order (and Q4_1's min becomes a float zero point -min / scale):
# measured 1e-6 .. 3e-6 here, 1.1e-6 on SmolLM2 Q4_1 and int4.
QUANT_TOLERANCE = 1e-4
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    tie_word_embeddings=False,
)
TINY_MODELS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"tie_word_embeddings": True}),
    "llama3_rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "rope_theta": 500000.0,
        },
    ),
    "mistral_window": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 8}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
}


def _make_tiny(kind: str, path: Path) -> Program:
    """A random-weight transformers model saved with save_pretrained, loaded and captured (O0)."""
    config_cls, model_cls, extra = TINY_MODELS[kind]
    torch.manual_seed(0)
    model = model_cls._from_config(config_cls(**{**COMMON, **extra}), attn_implementation="eager").eval()
    with torch.no_grad():  # biases and norm weights start at 0 and 1: make them random too
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, 256)}}
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>"
    ).save_pretrained(path)
    source = load_model(str(path))
    captured = capture_weights(source.config, source.float_weights())
    return Program(captured.graph, captured.weights)


def _as_gguf_q4_1(program: Program) -> Program:
    """The int4 program rewritten to GGUF Q4_1's layout: scale * q + min, "gguf" nibble order, f16
    scales and mins (the weights then stand for a slightly different model; both backends run it)."""
    weights = dict(program.weights)
    params = {}
    for param in program.graph.params:
        if param.name.endswith((".scales", ".zeros")):
            param = dataclasses.replace(param, type=dataclasses.replace(param.type, dtype="f16"))
        params[param.name] = param
    nodes = []
    for node in program.graph.nodes:
        inputs = tuple(params.get(v.name, v) if v is not None else None for v in node.inputs)
        if node.op == "quantized_linear":
            qweight, scales, zeros = (v.name for v in node.inputs[1:4])  # type: ignore[union-attr]
            weights[qweight] = pack_int4(unpack_int4(weights[qweight], "pairs"), "gguf")
            weights[zeros] = (-weights[zeros] * weights[scales]).to(torch.float16)
            weights[scales] = weights[scales].to(torch.float16)
            node = dataclasses.replace(node, attrs={**node.attrs, "scheme": "min", "packing": "gguf"})
        nodes.append(dataclasses.replace(node, inputs=inputs))
    graph = Graph(
        program.graph.name, program.graph.inputs, list(params.values()), nodes, program.graph.outputs
    )
    rewritten = Program(graph, weights)
    rewritten.verify()
    return rewritten


def _ragged_steps(executables: list[Executable]) -> list[list[torch.Tensor]]:
    """Two steps of a ragged batch on each executable; the logits of each step."""
    generator = torch.Generator().manual_seed(1234)
    tokens = {
        name: torch.randint(1, 256, (n,), generator=generator).tolist()
        for name, n in (("a", 21), ("b", 35), ("c", 35))
    }
    tables = {"a": [3, 7], "b": [1, 5, 9], "c": [2, 8, 4]}
    first = build_step_inputs(
        [SequenceSlice(tokens["a"][:20], 0, tables["a"]), SequenceSlice(tokens["c"][:10], 0, tables["c"])],
        BLOCK_SIZE,
    )
    second = build_step_inputs(
        [
            SequenceSlice(tokens["a"][20:], 20, tables["a"]),
            SequenceSlice(tokens["b"], 0, tables["b"]),
            SequenceSlice(tokens["c"][10:], 10, tables["c"]),
        ],
        BLOCK_SIZE,
    )
    results = []
    for executable in executables:
        cache = executable.kv_cache_spec.allocate(10, BLOCK_SIZE)
        results.append([executable.step(first, cache), executable.step(second, cache), cache])
    return results


def _relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def _compare(program: Program, folder: Path, tolerance: float) -> dict[str, str]:
    backend = OnnxRuntimeBackend()
    code = backend.compile(program, Target("cpu"), folder, CompileSettings(num_threads=2))
    ours = backend.load(folder, program.weights, Target("cpu"))
    reference = ReferenceExecutable(program.graph, program.weights)
    (first, second, cache), (ref_first, ref_second, ref_cache) = _ragged_steps([ours, reference])
    assert second.shape == (3, 256) and second.dtype == torch.float32
    worst = max(_relative_error(first, ref_first), _relative_error(second, ref_second))
    assert worst < tolerance
    assert _relative_error(cache, ref_cache) < tolerance  # the K/V written in place
    return code.kernels


@pytest.mark.parametrize("kind", sorted(TINY_MODELS))
def test_float32_ragged_batch_matches_the_reference(kind: str, tmp_path: Path) -> None:
    program = _make_tiny(kind, tmp_path / "hf")
    _compare(program, tmp_path / "o0", FLOAT_TOLERANCE)
    optimized, _ = PassManager(pipeline(2, PassOptions())).run(program)
    _compare(optimized, tmp_path / "o2", FLOAT_TOLERANCE)


@pytest.mark.parametrize("quantization", ["int4", "int8", "q4_1"])
def test_quantized_ragged_batch_matches_the_reference(quantization: str, tmp_path: Path) -> None:
    program = _make_tiny("qwen2", tmp_path / "hf")  # biases: the MatMulNBits + Add path
    scheme = "int4" if quantization == "q4_1" else quantization
    options = PassOptions(quantization=scheme, quantize_lm_head=True)
    quantized, _ = PassManager(pipeline(2, options)).run(program, options)
    if quantization == "q4_1":
        quantized = _as_gguf_q4_1(quantized)
    kernels = _compare(quantized, tmp_path / "ort", QUANT_TOLERANCE)
    expected = (
        "onnx Gemm (weight dequantized at load)" if quantization == "int8" else "com.microsoft.MatMulNBits"
    )
    assert kernels["quantized_linear"].startswith(expected)
