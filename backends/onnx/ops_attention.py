"""rope and paged_attention lowered to standard ONNX.

ONNX is functional, but the step contract writes K/V into the cache in place. The lowered graph takes
the cache as a read-only input and returns this step's new K/V rows of every layer as an extra output
[layers, 2, T, kv_heads, head_dim]; the executable scatters them into the cache at slot_mapping after
the run. Inside the run, attention must already see this step's K/V, so per layer:

1. gather each sequence's pages from the cache: [B, MB*BS, KVH, D] (only the blocks its table names);
2. ScatterND this step's K/V into that small copy at (sequence, position) — padding tokens (slot < 0)
   write back what is there, so they stay invisible as in the reference;
3. pad the ragged queries to [B, Qmax] rows, multiply with the keys of their own sequence (GQA: the
   query heads of one KV head share its keys), mask keys after the query's position (or from its
   visible end on, where the op has visible_ends) and outside the sliding window to the lowest float,
   softmax, multiply with V, gather the T real rows back.

Masked keys get probability exactly 0, so a row's result does not depend on what else is batched.
The indices (sequence of each token, padded rows, positions, masks) are built once per graph.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from kiln.backends.onnx.builder import ONNX_DTYPES
from kiln.backends.onnx.context import LoweringContext, LoweringOptions
from kiln.backends.onnx.rules import rule
from kiln.ir import KV_CACHE_INPUT, Node
from kiln.ir.ops.attention import rope_inv_freq

INT64_MAX = np.iinfo(np.int64).max


@dataclass(frozen=True)
class StepIndices:
    """Per-step index tensors every attention layer shares (ONNX value names)."""

    pad_rows: str  # [B, Qmax]: the token row behind each padded query row (clamped to T - 1)
    query_positions: str  # [B, Qmax]: the position of each padded query row
    scatter_at: str  # [T, 2]: (sequence, position) of each token of the step
    gather_back: str  # [T]: each token's row in the flattened [B * Qmax] padded rows
    written: str  # [T, 1, 1] bool: the token has a cache slot (slot >= 0)
    key_positions: str  # [S]: 0 .. MB * BS - 1
    num_blocks: str  # [1]: NB of the cache
    flat_cache: str  # the cache viewed as [layers * 2 * NB, BS, KVH, D]
    scores_shape: str  # [5]: 0, 0, -1, G, S (G = query heads per KV head)
    probs_shape: str  # [4]: 0, 0, -1, S


def _step_indices(ctx: LoweringContext, group: int) -> StepIndices:
    b = ctx.b
    one, zero = b.const([1]), b.const([0])
    qsl, seq_lens = "query_start_loc", "seq_lens"
    starts = b.op("Slice", qsl, zero, b.const([-1]))
    ends = b.op("Slice", qsl, one, b.const([INT64_MAX]))
    query_lens = b.op("Sub", ends, starts)
    first_positions = b.op("Sub", seq_lens, query_lens)
    num_tokens = b.op("Shape", "token_ids")
    max_query = b.op("ReduceMax", query_lens, keepdims=1)
    scalar = b.const(0)
    step1 = b.const(1)
    rows = b.op("Range", scalar, b.op("Squeeze", max_query, zero), step1)  # [Qmax]
    padded = b.op("Add", b.op("Unsqueeze", starts, one), b.op("Unsqueeze", rows, zero))
    pad_rows = b.op("Min", padded, b.op("Sub", num_tokens, one))
    query_positions = b.op("Add", b.op("Unsqueeze", first_positions, one), b.op("Unsqueeze", rows, zero))

    tokens = b.op("Range", scalar, b.op("Squeeze", num_tokens, zero), step1)  # [T]
    ended = b.op("GreaterOrEqual", b.op("Unsqueeze", tokens, one), b.op("Unsqueeze", ends, zero))
    sequence = b.op("ReduceSum", b.op("Cast", ended, to=ONNX_DTYPES["i64"]), one, keepdims=0)  # [T]
    row_in_sequence = b.op("Sub", tokens, b.op("Gather", starts, sequence, axis=0))
    position = b.op("Add", b.op("Gather", first_positions, sequence, axis=0), row_in_sequence)
    scatter_at = b.op("Concat", b.op("Unsqueeze", sequence, one), b.op("Unsqueeze", position, one), axis=1)
    gather_back = b.op("Add", b.op("Mul", sequence, max_query), row_in_sequence)
    written = b.op("GreaterOrEqual", "slot_mapping", b.const(0))
    written = b.op("Unsqueeze", written, b.const([1, 2]))

    cache_shape = b.op("Shape", KV_CACHE_INPUT)
    num_blocks = b.op("Slice", cache_shape, b.const([2]), b.const([3]))
    block_size = b.op("Slice", cache_shape, b.const([3]), b.const([4]))
    max_blocks = b.op("Slice", b.op("Shape", "block_tables"), one, b.const([2]))
    span = b.op("Mul", max_blocks, block_size)  # [1]: S
    key_positions = b.op("Range", scalar, b.op("Squeeze", span, zero), step1)
    flat_shape = b.op("Concat", b.const([-1]), b.op("Slice", cache_shape, b.const([3]), b.const([6])), axis=0)
    flat_cache = b.op("Reshape", KV_CACHE_INPUT, flat_shape)
    scores_shape = b.op("Concat", b.const([0, 0, -1, group]), span, axis=0)
    probs_shape = b.op("Concat", b.const([0, 0, -1]), span, axis=0)
    return StepIndices(
        pad_rows,
        query_positions,
        scatter_at,
        gather_back,
        written,
        key_positions,
        num_blocks,
        flat_cache,
        scores_shape,
        probs_shape,
    )


def _mask(ctx: LoweringContext, idx: StepIndices, window: int | None, visible_ends: str | None) -> str:
    """[B, 1, Qmax, 1, S] bool: which keys each padded query row sees (with `visible_ends`, the keys
    before its row's end instead of those up to its position)."""
    b = ctx.b
    keys = b.op("Unsqueeze", idx.key_positions, b.const([0, 1]))  # [1, 1, S]
    queries = b.op("Unsqueeze", idx.query_positions, b.const([2]))  # [B, Qmax, 1]
    if visible_ends is None:
        visible = b.op("LessOrEqual", keys, queries)
    else:
        ends = b.op("Gather", visible_ends, idx.pad_rows, axis=0)  # [B, Qmax]
        visible = b.op("Less", keys, b.op("Unsqueeze", ends, b.const([2])))
    if window is not None:
        oldest = b.op("Sub", queries, b.const(window))
        visible = b.op("And", visible, b.op("Greater", keys, oldest))
    return b.op("Unsqueeze", visible, b.const([1, 3]))


def _rope_tables(
    ctx: LoweringContext, positions: str, attrs: dict, head_dim: int, dtype: str
) -> tuple[str, str]:
    """cos, sin [T, 1, head_dim] at `positions`, as the rope reference computes them."""
    b = ctx.b
    inv_freq = rope_inv_freq(head_dim, **attrs).numpy()
    freqs = b.op(
        "Mul",
        b.op("Unsqueeze", b.op("Cast", positions, to=ONNX_DTYPES["f32"]), b.const([1])),
        b.const(inv_freq[None, :], np.float32),
    )
    angles = b.op("Unsqueeze", b.op("Concat", freqs, freqs, axis=-1), b.const([1]))
    cos, sin = b.op("Cos", angles), b.op("Sin", angles)
    scale = float(attrs.get("attention_factor", 1.0))
    if scale != 1.0:
        factor = b.const(np.array(scale, np.float32), np.float32)
        cos, sin = b.op("Mul", cos, factor), b.op("Mul", sin, factor)
    if dtype != "f32":
        cos, sin = b.op("Cast", cos, to=ONNX_DTYPES[dtype]), b.op("Cast", sin, to=ONNX_DTYPES[dtype])
    return cos, sin


def rope(
    ctx: LoweringContext,
    x: str,
    positions: str,
    attrs: dict,
    head_dim: int,
    dtype: str,
    outputs: list[str] | int = 1,
) -> str:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]."""
    b = ctx.b
    key = ("rope", positions, json.dumps(attrs, sort_keys=True), head_dim, dtype)
    cos, sin = ctx.cached(key, lambda: _rope_tables(ctx, positions, attrs, head_dim, dtype))
    first, second = b.node("Split", [x], 2, axis=-1, num_outputs=2)
    rotated = b.op("Concat", b.op("Neg", second), first, axis=-1)
    (out,) = b.node("Add", [b.op("Mul", x, cos), b.op("Mul", rotated, sin)], outputs)
    return out


def _rope_check(node: Node, options: LoweringOptions) -> str | None:
    x = node.inputs[0]
    if x is None or not isinstance(x.type.shape[-1], int):
        return "rope needs a known head_dim"
    return None


@rule("rope", _rope_check)
def _rope(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    x, positions = node.inputs[0], node.inputs[1]
    assert x is not None and positions is not None
    rope(
        ctx, ctx.name(x), ctx.name(positions), dict(node.attrs), int(x.type.shape[-1]), x.type.dtype, outputs
    )
    return "onnx Cos, Sin, Mul, Add"


def _attention_check(node: Node, options: LoweringOptions) -> str | None:
    cache = node.inputs[3]
    if cache is None or cache.name != KV_CACHE_INPUT:
        return f"paged_attention must read the step's {KV_CACHE_INPUT} input"
    names = [v.name if v is not None else None for v in node.inputs[4:8]]
    if names != ["slot_mapping", "block_tables", "seq_lens", "query_start_loc"]:
        return "paged_attention must read the step's slot_mapping, block_tables, seq_lens, query_start_loc"
    if not all(isinstance(d, int) for d in cache.type.shape[4:]) or not isinstance(cache.type.shape[0], int):
        return "the cache needs known layers, kv heads and head dim"
    if cache.type.dtype == "f8e4m3":
        return (
            "a float8 KV cache (--kv-cache-dtype fp8_e4m3) runs on the TVM backend only; compile with "
            "--backend tvm, or without --kv-cache-dtype"
        )
    return None


def _cache_pages(ctx: LoweringContext, idx: StepIndices, layer: int, which: int, new: str) -> str:
    """[B, S, KVH, D]: the sequences' pages of one layer's keys (which=0) or values, with `new` rows
    [T, KVH, D] written at their positions."""
    b = ctx.b
    base = b.op("Mul", idx.num_blocks, b.const([layer * 2 + which]))
    pages = b.op("Gather", idx.flat_cache, b.op("Add", "block_tables", base), axis=0)  # [B, MB, BS, KVH, D]
    kv_heads, head_dim = ctx.graph.input(KV_CACHE_INPUT).type.shape[4:]
    pages = b.op("Reshape", pages, b.const([0, -1, kv_heads, head_dim]))
    kept = b.op("Where", idx.written, new, b.op("GatherND", pages, idx.scatter_at))
    return b.op("ScatterND", pages, idx.scatter_at, kept)


@rule("paged_attention", _attention_check)
def _paged_attention(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    b = ctx.b
    q_value, k_value, v_value = node.inputs[0], node.inputs[1], node.inputs[2]
    assert q_value is not None and k_value is not None and v_value is not None
    layer, scale = int(node.attrs["layer"]), float(node.attrs["scale"])  # type: ignore[arg-type]
    window = node.attrs.get("sliding_window")
    heads, kv_heads, head_dim = (
        int(q_value.type.shape[1]),
        int(k_value.type.shape[1]),
        int(q_value.type.shape[2]),
    )
    group = heads // kv_heads
    dtype = q_value.type.dtype
    cache_dtype = ctx.graph.input(KV_CACHE_INPUT).type.dtype
    q, k, v = ctx.name(q_value), ctx.name(k_value), ctx.name(v_value)
    rope_attrs = node.attrs.get("rope")
    if isinstance(rope_attrs, dict):
        at = ctx.name(node.inputs[8])  # type: ignore[arg-type]
        q, k = rope(ctx, q, at, rope_attrs, head_dim, dtype), rope(ctx, k, at, rope_attrs, head_dim, dtype)
    if cache_dtype != dtype:
        k, v = b.op("Cast", k, to=ONNX_DTYPES[cache_dtype]), b.op("Cast", v, to=ONNX_DTYPES[cache_dtype])
    ctx.kv_outputs[layer] = (k, v)

    idx = ctx.cached(("attention", group), lambda: _step_indices(ctx, group))
    ends_value = node.inputs[9] if len(node.inputs) > 9 else None
    ends = ctx.name(ends_value) if ends_value is not None else None
    window_size = window if isinstance(window, int) else None
    mask = ctx.cached(("mask", window, ends), lambda: _mask(ctx, idx, window_size, ends))
    keys = _cache_pages(ctx, idx, layer, 0, k)
    values = _cache_pages(ctx, idx, layer, 1, v)
    if cache_dtype != "f32":
        keys, values = b.op("Cast", keys, to=ONNX_DTYPES["f32"]), b.op("Cast", values, to=ONNX_DTYPES["f32"])
    query = q if dtype == "f32" else b.op("Cast", q, to=ONNX_DTYPES["f32"])
    padded = b.op("Gather", query, idx.pad_rows, axis=0)  # [B, Qmax, H, D]
    padded = b.op("Reshape", padded, b.const([0, 0, kv_heads, group, head_dim]))
    padded = b.op("Transpose", padded, perm=[0, 2, 1, 3, 4])  # [B, KVH, Qmax, G, D]
    padded = b.op("Reshape", padded, b.const([0, 0, -1, head_dim]))  # [B, KVH, Qmax * G, D]
    scores = b.op("MatMul", padded, b.op("Transpose", keys, perm=[0, 2, 3, 1]))  # [B, KVH, Qmax * G, S]
    scores = b.op("Mul", scores, b.const(scale, np.float32))
    scores = b.op("Reshape", scores, idx.scores_shape)  # [B, KVH, Qmax, G, S]
    lowest = b.const(np.finfo(np.float32).min, np.float32)
    probs = b.op("Softmax", b.op("Where", mask, scores, lowest), axis=-1)
    probs = b.op("Reshape", probs, idx.probs_shape)
    out = b.op("MatMul", probs, b.op("Transpose", values, perm=[0, 2, 1, 3]))  # [B, KVH, Qmax * G, D]
    out = b.op("Reshape", out, b.const([0, 0, -1, group, head_dim]))
    out = b.op("Transpose", out, perm=[0, 2, 1, 3, 4])  # [B, Qmax, KVH, G, D]
    out = b.op("Reshape", out, b.const([-1, heads, head_dim]))
    if dtype == "f32":
        b.node("Gather", [out, idx.gather_back], outputs, axis=0)
    else:
        b.node("Cast", [b.op("Gather", out, idx.gather_back, axis=0)], outputs, to=ONNX_DTYPES[dtype])
    return "onnx Gather pages, ScatterND, MatMul, masked Softmax"
