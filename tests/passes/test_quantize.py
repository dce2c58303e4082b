"""Quantization: GGUF blocks import bit-identically; int8/int4 quantize within their error bounds; the
swap pass makes quantized_linear nodes that compute what the dequantized weights compute."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from kiln.ir import print_graph
from kiln.ir.interpreter import interpret
from kiln.ir.ops.quant import dequantize
from kiln.passes import PassError, PassOptions
from kiln.passes.quantize.quantizers import import_gguf, quantize_int4, quantize_int8
from kiln.passes.quantize.swap import quantize_linears


def _dequantized(q) -> torch.Tensor:
    return dequantize(q.qweight, q.scales, q.zeros, **q.attrs())


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_import_bit_identically(ggml_type: str) -> None:
    weight = np.random.default_rng(0).standard_normal((12, 96)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[ggml_type]
    blocks = gguf.quants.quantize(weight, qtype)
    expected = gguf.quants.dequantize(blocks, qtype)
    imported = import_gguf(ggml_type, blocks, (12, 96), "w")
    assert torch.equal(_dequantized(imported), torch.from_numpy(expected))


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "Q5_0", "Q5_1"])
def test_kquant_and_q5_blocks_import_bit_identically(ggml_type: str, random_gguf_blocks) -> None:
    from kiln.frontend.source import QuantizedTensor

    rows, k = 16, 512
    blocks = random_gguf_blocks(ggml_type, rows, k)
    expected = QuantizedTensor(ggml_type, (rows, k), blocks).dequantize()  # gguf.quants.dequantize
    assert torch.isfinite(expected).all()
    imported = import_gguf(ggml_type, blocks, (rows, k), "w")
    # their own f16 d (and m) for Q5_0 and Q5_1; products d * sc as float32 for the K-quants
    assert imported.scales.dtype == (torch.float16 if ggml_type in ("Q5_0", "Q5_1") else torch.float32)
    ours = _dequantized(imported)
    assert torch.equal(ours, expected)
    assert torch.equal(ours.view(torch.int32), expected.view(torch.int32))  # to the bit, signed zeros too


def test_smollm2_q4_1_blocks_import_bit_identically(smollm2_gguf_path) -> None:
    from kiln.frontend.gguf_loader import load_gguf

    source = load_gguf(smollm2_gguf_path)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        weight = source.weights[name]
        imported = import_gguf(weight.ggml_type, weight.read(), weight.shape, name)
        assert torch.equal(_dequantized(imported), weight.dequantize())


def test_int8_and_int4_stay_within_their_step() -> None:
    weight = torch.randn(16, 128, generator=torch.Generator().manual_seed(3))
    q8 = quantize_int8(weight)
    inside = weight.abs() <= q8.scales * 127
    assert (
        (_dequantized(q8) - weight).abs()[inside] <= (q8.scales / 2 + 1e-6).expand_as(weight)[inside]
    ).all()
    plain_scales = weight.abs().amax(dim=1, keepdim=True) / 127
    plain_error = ((torch.round(weight / plain_scales) * plain_scales - weight) ** 2).sum(dim=1)
    assert (((_dequantized(q8) - weight) ** 2).sum(dim=1) <= plain_error + 1e-6).all()
    assert q8.qweight.dtype == torch.int8
    for group in (32, 64, 128):
        q4 = quantize_int4(weight, group)
        groups = weight.reshape(16, -1, group)
        step4 = (groups.amax(-1) - groups.amin(-1)) / 15
        error = (_dequantized(q4) - weight).reshape(16, -1, group).abs()
        assert (error <= step4.unsqueeze(-1) * 0.5 + 1e-5).all()
        assert q4.qweight.shape == (16, 64)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_swap_quantizes_linears_but_not_the_lm_head(kit, quantization: str) -> None:
    text = """\
graph g(%x: f32[T,64], %ids: i64[T]) {
  param @emb: f32[50,64]
  param @a.weight: f32[32,64]
  param @a.bias: f32[32]
  %0: f32[T,64] = embedding(@emb, %ids)
  %1: f32[T,64] = add(%0, %x)
  %2: f32[T,32] = linear(%1, @a.weight, @a.bias)
  %3: f32[T,50] = linear(%1, @emb)
  return %2, %3
}
"""
    program = kit.program_from_text(text)
    after, changed = quantize_linears(program, PassOptions(quantization=quantization))
    after.verify()
    assert changed and after.graph.op_counts() == {
        "embedding": 1,
        "add": 1,
        "quantized_linear": 1,
        "linear": 1,
    }
    printed = print_graph(after.graph)
    assert "quantized_linear(%1, @a.weight.qweight, @a.weight.scales" in printed
    inputs = {"x": torch.randn(5, 64), "ids": torch.tensor([1, 2, 3, 4, 5])}
    got = interpret(after.graph, after.weights, inputs)
    want = interpret(program.graph, program.weights, inputs)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)  # the LM head stayed float
    relative = (got[0] - want[0]).abs().max() / want[0].abs().max()
    assert relative < (0.02 if quantization == "int8" else 0.15)


def test_group_size_that_does_not_divide_is_named(kit) -> None:
    program = kit.program_from_text("""\
graph g(%x: f32[T,48]) {
  param @layer.weight: f32[8,48]
  %0: f32[T,8] = linear(%x, @layer.weight)
  return %0
}
""")
    with pytest.raises(
        PassError, match=r"weight layer.weight: in_features 48 is not a multiple of group size 32"
    ):
        quantize_linears(program, PassOptions(quantization="int4", group_size=32))


def test_bad_options_are_named() -> None:
    with pytest.raises(PassError, match="unknown quantization 'int3'"):
        PassOptions(quantization="int3")
    with pytest.raises(PassError, match="group_size 48"):
        PassOptions(quantization="int4", group_size=48)


def test_a_large_tensor_imports_a_slice_of_rows_at_a_time(monkeypatch, random_gguf_blocks) -> None:
    from kiln.passes.quantize import gguf_kquants

    blocks = random_gguf_blocks("Q6_K", 40, 512, seed=3)
    whole = gguf_kquants.import_kquant("Q6_K", blocks, (40, 512))
    monkeypatch.setattr(gguf_kquants, "IMPORT_ROWS", 16)
    sliced = gguf_kquants.import_kquant_rows("Q6_K", blocks, (40, 512))
    assert torch.equal(sliced.q, whole.q) and torch.equal(sliced.scales, whole.scales)
    assert sliced.mins is None and whole.mins is None


TIED = """\
graph g(%ids: i64[T]) {
  param @emb: f32[64,256]
  %0: f32[T,256] = embedding(@emb, %ids)
  %1: f32[T,64] = linear(%0, @emb)
  return %0, %1
}
"""


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q6_K", "Q5_0", "Q4_0", "Q8_0"])
def test_gguf_tables_are_gathered_from_their_blocks(kit, random_gguf_blocks, ggml_type: str) -> None:
    """The embedding reads the GGUF blocks (only the rows asked for are dequantized), bit-identical to
    the dequantized table; a tied LM head reads the same params."""
    from kiln.ir.gguf_blocks import QuantizedTensor

    program = kit.program_from_text(TIED)
    blocks = QuantizedTensor(ggml_type, (64, 256), random_gguf_blocks(ggml_type, 64, 256, seed=5))
    options = PassOptions(quantization="gguf", gguf_blocks={"emb": blocks}, quantize_lm_head=True)
    after, changed = quantize_linears(program, options)
    after.verify()
    assert changed and after.graph.op_counts() == {"quantized_embedding": 1, "quantized_linear": 1}
    embedding, head = after.graph.nodes
    assert embedding.inputs[1:] == head.inputs[1:]  # one qweight, scales (and zeros) for both
    ids = torch.tensor([63, 0, 7, 7, 31])
    got = interpret(after.graph, after.weights, {"ids": ids})
    table = blocks.dequantize()
    assert torch.equal(got[0], table[ids])

    float_program, _ = quantize_linears(program, dataclasses.replace(options, dtype="f16"))
    assert float_program.graph.op_counts()["embedding"] == 1  # a float16 program keeps a float table
