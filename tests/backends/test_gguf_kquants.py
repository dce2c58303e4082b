"""Every GGUF K-quant and Q5 type, imported as its blocks, through the TVM CPU and ONNX Runtime kernels
against the reference (which dequantizes bit-identically to gguf): a one-layer Llama whose linear
layers and LM head are random blocks of every type in turn (a mix, as in the files people download)
and whose embedding table is Q4_K blocks, prefills of 1, 4, 16 and 64 rows; one with Q4_0, Q4_1 and
Q8_0 linears and a Q4_0 table; and a one-layer Mixtral whose experts are Q4_K_M's mix (Q4_K gate and up, Q6_K
down) and whose table is Q6_K. Each type's kernel on every instruction set is checked alone in
tvm/kernels/test_int_dot.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kiln.backends.base import CompileSettings
from kiln.backends.reference import ReferenceExecutable
from kiln.backends.targets import Target
from kiln.compiler.build import PipelineOptions, optimize
from kiln.frontend.config import ModelConfig
from kiln.frontend.models import model_class
from kiln.frontend.source import ModelSource, QuantizedTensor, TokenizerInfo
from kiln.ir.step import SequenceSlice, build_step_inputs

pytestmark = pytest.mark.slow  # a TVM and an ONNX Runtime compile per model

TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "Q5_0", "Q5_1")
ROWS = (1, 4, 16, 64)
# max |ours - reference| / max |reference|, on the logits. ONNX Runtime's float32 kernels regroup the
# sums: only rounding differs. TVM's integer-dot kernels quantize the activations to 16 bits a block
# (kernels/int_dot.py): a relative error of about 1/32385 of each block's largest value, and more
# where the logits cancel (measured up to 1.4e-3, Q6_K at 64 rows).
TOLERANCE = {"onnxruntime": 1e-4, "tvm": 3e-3}
CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=128,
)


MOE_CONFIG = dataclasses.replace(
    CONFIG,
    architecture="MixtralForCausalLM",
    intermediate_size=256,
    num_experts=4,
    num_experts_per_tok=2,
)


def _program(
    ggml_types: tuple[str, ...], random_gguf_blocks, embedding_type: str, config: ModelConfig = CONFIG
):
    """The one-layer model whose linear weights (and LM head), in name order, are random blocks of
    `ggml_types` in turn; experts' down projections Q6_K (as in Q4_K_M files); routers float; the
    embedding table `embedding_type`'s blocks (a quantized_embedding)."""
    with torch.device("meta"):
        shapes = model_class(config)(config).state_dict()
    generator = torch.Generator().manual_seed(0)
    weights: dict[str, torch.Tensor | QuantizedTensor] = {}
    linears = 0
    for seed, (name, tensor) in enumerate(sorted(shapes.items())):
        if name == "model.embed_tokens.weight":
            blocks = random_gguf_blocks(embedding_type, *tensor.shape, seed, edges=False)
            weights[name] = QuantizedTensor(embedding_type, tuple(tensor.shape), blocks)
        elif tensor.dim() >= 2 and not name.endswith("mlp.gate.weight"):
            rows, k = tensor.shape[:-1].numel(), tensor.shape[-1]
            expert_down = name.endswith("experts.down_proj.weight")
            kind = "Q6_K" if expert_down else ggml_types[linears % len(ggml_types)]
            linears += 1
            blocks = random_gguf_blocks(kind, rows, k, seed, edges=False)
            weights[name] = QuantizedTensor(kind, tuple(tensor.shape), blocks)
        else:
            weights[name] = 1.0 + 0.1 * torch.randn(tensor.shape, generator=generator)
    assert linears >= len(ggml_types), (linears, ggml_types)  # every type is in the model
    tokenizer = TokenizerInfo("{}", None, None, None, False, ())
    source = ModelSource("kquant", Path("kquant.gguf"), config, weights, tokenizer)
    floats = source.float_weights()
    optimized = optimize(config, floats, PipelineOptions(opt_level=2, quantization="gguf"), source)
    assert optimized.quantization == "gguf"
    (embedding,) = [node for node in optimized.program.graph.nodes if "embedding" in node.op]
    assert embedding.op == "quantized_embedding"
    return optimized.program


def _logits(executable, num_rows: int) -> torch.Tensor:
    tokens = torch.randint(
        0, CONFIG.vocab_size, (num_rows,), generator=torch.Generator().manual_seed(num_rows)
    )
    blocks = list(range(1, -(-num_rows // 16) + 1))
    inputs = build_step_inputs([SequenceSlice(tokens.tolist(), 0, blocks, list(range(num_rows)))], 16)
    return torch.from_numpy(executable.step(inputs, executable.kv_cache_spec.allocate(len(blocks) + 1, 16)))


def test_tvm_and_onnxruntime_match_the_reference(tmp_path: Path, random_gguf_blocks) -> None:
    _check_backends(_program(TYPES, random_gguf_blocks, "Q4_K"), "every type", tmp_path)


def test_legacy_types_as_linears_and_table(tmp_path: Path, random_gguf_blocks) -> None:
    """Q4_0 (zero point 8), Q4_1 (a minimum) and Q8_0 linears through the compiled integer-dot kernels,
    and the legacy 4-bit order (element j low, j + 16 high) gathered from a Q4_0 table."""
    program = _program(("Q4_0", "Q4_1", "Q8_0"), random_gguf_blocks, "Q4_0")
    _check_backends(program, "Q4_0 / Q4_1 / Q8_0 linears, Q4_0 table", tmp_path)


def test_q4_k_m_experts(tmp_path: Path, random_gguf_blocks) -> None:
    program = _program(("Q4_K",), random_gguf_blocks, "Q6_K", MOE_CONFIG)
    moe = next(node for node in program.graph.nodes if node.op == "quantized_moe")
    assert (moe.attrs["gate"]["bits"], moe.attrs["down"].get("value_bits")) == (4, 6)
    _check_backends(program, "Q4_K / Q6_K experts", tmp_path)


def _check_backends(program, ggml_type: str, tmp_path: Path) -> None:
    from kiln.backends.onnxruntime.backend import OnnxRuntimeBackend
    from kiln.backends.tvm.backend import TVMBackend

    reference = ReferenceExecutable(program.graph, program.weights)
    executables = {}
    for backend in (TVMBackend(), OnnxRuntimeBackend()):
        folder = tmp_path / backend.name
        code = backend.compile(program, Target("cpu"), folder, CompileSettings(max_model_len=128))
        if backend.name == "tvm":  # the blocks run through the integer-dot kernels, not dequantized
            assert any(name.startswith("qdot") for name in code.kernels), code.kernels
        executables[backend.name] = backend.load(folder, program.weights, Target("cpu"))
    for num_rows in ROWS:
        expected = _logits(reference, num_rows)
        assert expected.shape == (num_rows, CONFIG.vocab_size) and torch.isfinite(expected).all()
        for name, executable in executables.items():
            error = float((_logits(executable, num_rows) - expected).abs().max() / expected.abs().max())
            assert error < TOLERANCE[name], (ggml_type, name, num_rows, error)
