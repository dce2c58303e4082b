"""Fusion passes: golden before/after text, structural equality, remaining ops, same numbers."""

from __future__ import annotations

from kiln.passes.fusion.add_rms_norm import fuse_add_rms_norm
from kiln.passes.fusion.logits_rows import push_take_rows
from kiln.passes.fusion.parallel_linears import fuse_parallel_linears
from kiln.passes.fusion.rope_attention import fuse_rope_attention
from kiln.passes.fusion.swiglu import fuse_swiglu

SIZES = {"T": 6, "B": 2}


def test_qkv_projections_fuse_with_their_biases(kit) -> None:
    before = """\
graph g(%x: f32[T,8]) {
  param @attn.q_proj.weight: f32[8,8]
  param @attn.q_proj.bias: f32[8]
  param @attn.k_proj.weight: f32[4,8]
  param @attn.k_proj.bias: f32[4]
  param @attn.v_proj.weight: f32[4,8]
  param @attn.v_proj.bias: f32[4]
  %0: f32[T,8] = linear(%x, @attn.q_proj.weight, @attn.q_proj.bias)
  %1: f32[T,4] = linear(%x, @attn.k_proj.weight, @attn.k_proj.bias)
  %2: f32[T,4] = linear(%x, @attn.v_proj.weight, @attn.v_proj.bias)
  %3: f32[T,4] = add(%1, %2)
  return %0, %3
}
"""
    expected = """\
graph g(%x: f32[T,8]) {
  param @attn.qkv_proj.weight: f32[16,8]
  param @attn.qkv_proj.bias: f32[16]
  %4: f32[T,16] = linear(%x, @attn.qkv_proj.weight, @attn.qkv_proj.bias)
  %5: f32[T,8], %6: f32[T,4], %7: f32[T,4] = split(%4) {"sizes": [8, 4, 4]}
  %3: f32[T,4] = add(%6, %7)
  return %5, %3
}
"""
    after = kit.check(fuse_parallel_linears, before, expected, SIZES)
    assert after.graph.op_counts() == {"linear": 1, "split": 1, "add": 1}


def test_gate_up_fuse_then_swiglu_reads_the_fused_output(kit) -> None:
    before = """\
graph g(%x: f32[T,8]) {
  param @mlp.gate_proj.weight: f32[6,8]
  param @mlp.up_proj.weight: f32[6,8]
  %0: f32[T,6] = linear(%x, @mlp.gate_proj.weight)
  %1: f32[T,6] = silu(%0)
  %2: f32[T,6] = linear(%x, @mlp.up_proj.weight)
  %3: f32[T,6] = mul(%1, %2)
  return %3
}
"""
    fused_linears = """\
graph g(%x: f32[T,8]) {
  param @mlp.gate_up_proj.weight: f32[12,8]
  %4: f32[T,12] = linear(%x, @mlp.gate_up_proj.weight)
  %5: f32[T,6], %6: f32[T,6] = split(%4) {"sizes": [6, 6]}
  %1: f32[T,6] = silu(%5)
  %3: f32[T,6] = mul(%1, %6)
  return %3
}
"""
    expected = """\
graph g(%x: f32[T,8]) {
  param @mlp.gate_up_proj.weight: f32[12,8]
  %4: f32[T,12] = linear(%x, @mlp.gate_up_proj.weight)
  %7: f32[T,6] = swiglu(%4)
  return %7
}
"""
    kit.check(fuse_parallel_linears, before, fused_linears, SIZES)
    after = kit.check(fuse_swiglu, fused_linears, expected, SIZES)
    assert "silu" not in after.graph.op_counts() and "mul" not in after.graph.op_counts()


def test_swiglu_of_separate_gate_and_up(kit) -> None:
    before = """\
graph g(%a: f32[T,6], %b: f32[T,6]) {
  %0: f32[T,6] = silu(%a)
  %1: f32[T,6] = mul(%0, %b)
  return %1
}
"""
    expected = """\
graph g(%a: f32[T,6], %b: f32[T,6]) {
  %2: f32[T,6] = swiglu(%a, %b)
  return %2
}
"""
    kit.check(fuse_swiglu, before, expected, SIZES)


def test_residual_add_and_rms_norm_fuse(kit) -> None:
    before = """\
graph g(%x: f32[T,8], %r: f32[T,8]) {
  param @n: f32[8]
  %0: f32[T,8] = add(%x, %r)
  %1: f32[T,8] = rms_norm(%0, @n) {"eps": 1e-05}
  %2: f32[T,8] = mul(%1, %0)
  return %2
}
"""
    expected = """\
graph g(%x: f32[T,8], %r: f32[T,8]) {
  param @n: f32[8]
  %3: f32[T,8], %4: f32[T,8] = add_rms_norm(%x, %r, @n) {"eps": 1e-05}
  %2: f32[T,8] = mul(%3, %4)
  return %2
}
"""
    after = kit.check(fuse_add_rms_norm, before, expected, SIZES)
    assert after.graph.op_counts() == {"add_rms_norm": 1, "mul": 1}


ATTENTION_INPUTS = (
    "%q: f32[T,4,8], %k: f32[T,2,8], %v: f32[T,2,8], %kv_cache: f32[1,2,NB,BS,2,8], %slot_mapping: i64[T], "
    "%block_tables: i64[B,MB], %seq_lens: i64[B], %query_start_loc: i64[B1], %positions: i64[T]"
)


CACHE_ARGS = "%kv_cache, %slot_mapping, %block_tables, %seq_lens, %query_start_loc"
FUSED_ATTRS = '"layer": 0, "rope": {"theta": 10000.0}, "scale": 0.35'


def test_rope_moves_into_attention(kit) -> None:
    before = f"""\
graph g({ATTENTION_INPUTS}) {{
  %0: f32[T,4,8] = rope(%q, %positions) {{"theta": 10000.0}}
  %1: f32[T,2,8] = rope(%k, %positions) {{"theta": 10000.0}}
  %2: f32[T,4,8] = paged_attention(%0, %1, %v, {CACHE_ARGS}) {{"layer": 0, "scale": 0.35}}
  return %2
}}
"""
    expected = f"""\
graph g({ATTENTION_INPUTS}) {{
  %3: f32[T,4,8] = paged_attention(%q, %k, %v, {CACHE_ARGS}, %positions) {{{FUSED_ATTRS}}}
  return %3
}}
"""
    program = kit.program_from_text(before)
    after, changed = fuse_rope_attention(program, None)
    after.verify()
    from kiln.ir import print_graph

    assert changed and print_graph(after.graph) == expected
    _check_attention_numbers(kit, program, after)


def _check_attention_numbers(kit, before, after) -> None:
    import torch

    from kiln.ir.interpreter import interpret

    inputs = kit.random_inputs(before, {"T": 6, "NB": 4, "BS": 4, "B": 2, "MB": 2, "B1": 3})
    inputs |= {
        "kv_cache": torch.zeros(1, 2, 4, 4, 2, 8),
        "slot_mapping": torch.arange(6) + 4,
        "block_tables": torch.tensor([[1, 2], [3, 0]]),
        "seq_lens": torch.tensor([4, 2]),
        "query_start_loc": torch.tensor([0, 4, 6]),
        "positions": torch.tensor([0, 1, 2, 3, 0, 1]),
    }
    cache_before, cache_after = inputs["kv_cache"].clone(), inputs["kv_cache"].clone()
    (want,) = interpret(before.graph, before.weights, inputs | {"kv_cache": cache_before})
    (got,) = interpret(after.graph, after.weights, inputs | {"kv_cache": cache_after})
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(cache_after, cache_before)


def test_take_rows_moves_above_row_wise_work(kit) -> None:
    before = """\
graph g(%h: f32[T,8], %idx: i64[B]) {
  param @norm: f32[8]
  param @head: f32[16,8]
  %0: f32[T,8] = rms_norm(%h, @norm) {"eps": 1e-05}
  %1: f32[T,16] = linear(%0, @head)
  %2: f32[B,16] = take_rows(%1, %idx)
  return %2
}
"""
    expected = """\
graph g(%h: f32[T,8], %idx: i64[B]) {
  param @norm: f32[8]
  param @head: f32[16,8]
  %0: f32[T,8] = rms_norm(%h, @norm) {"eps": 1e-05}
  %3: f32[B,8] = take_rows(%0, %idx)
  %4: f32[B,16] = linear(%3, @head)
  return %4
}
"""
    once = kit.check(push_take_rows, before, expected, SIZES)
    twice, changed = push_take_rows(once, None)
    assert changed
    node_ops = [node.op for node in twice.graph.nodes]
    assert node_ops == ["take_rows", "rms_norm", "linear"]
