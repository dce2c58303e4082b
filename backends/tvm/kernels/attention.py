"""Paged attention on the CPU as TIR: write this step's K/V into the cache, then attend row by row.

The cache is the runtime's [layers, 2, blocks, block_size, kv_heads, head_dim] tensor, written in
place (Relax `call_tir_inplace`). Each (query row, head) is one parallel task with an online softmax
over exactly the keys that row may see, so a row's result never depends on the rest of the batch.
Rows outside every sequence (the executable's padding) get zeros.
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T


def _lanes(head_dim: int) -> int:
    return math.gcd(head_dim, 16)


def kv_write_kernel(kv_heads: int, head_dim: int, dtype: str) -> tirx.PrimFunc:
    @T.prim_func(s_tir=True)
    def kv_write(
        k_handle: T.handle, v_handle: T.handle, cache_handle: T.handle, slot_handle: T.handle, layer: T.int64
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int64()
        num_layers = T.int64()
        num_blocks = T.int64()
        block_size = T.int64()
        k = T.match_buffer(k_handle, (n, kv_heads, head_dim), dtype)
        v = T.match_buffer(v_handle, (n, kv_heads, head_dim), dtype)
        cache = T.match_buffer(
            cache_handle, (num_layers, 2, num_blocks, block_size, kv_heads, head_dim), dtype
        )
        slots = T.match_buffer(slot_handle, (n,), "int64")
        for row in T.serial(n):
            with T.sblock("write"):
                T.reads()
                T.writes()
                slot: T.let[T.int64] = slots[row]
                if slot >= 0:
                    for h in T.serial(kv_heads):
                        for d in T.vectorized(head_dim):
                            cache[layer, 0, slot // block_size, slot % block_size, h, d] = k[row, h, d]
                            cache[layer, 1, slot // block_size, slot % block_size, h, d] = v[row, h, d]

    return kv_write


def attention_kernel(
    heads: int, kv_heads: int, head_dim: int, scale: float, sliding_window: int | None, dtype: str
) -> tirx.PrimFunc:
    group = heads // kv_heads
    lanes = _lanes(head_dim)
    chunks = head_dim // lanes
    window = sliding_window or (1 << 62)  # no window: every earlier position is visible

    @T.prim_func(s_tir=True)
    def attention(
        q_handle: T.handle,
        cache_handle: T.handle,
        tables_handle: T.handle,
        lens_handle: T.handle,
        starts_handle: T.handle,
        layer: T.int64,
        out_handle: T.handle,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int64()
        num_layers = T.int64()
        num_blocks = T.int64()
        block_size = T.int64()
        num_seqs = T.int64()
        max_blocks = T.int64()
        num_starts = T.int64()
        q = T.match_buffer(q_handle, (n, heads, head_dim), dtype)
        cache = T.match_buffer(
            cache_handle, (num_layers, 2, num_blocks, block_size, kv_heads, head_dim), dtype
        )
        tables = T.match_buffer(tables_handle, (num_seqs, max_blocks), "int64")
        lens = T.match_buffer(lens_handle, (num_seqs,), "int64")
        starts = T.match_buffer(starts_handle, (num_starts,), "int64")
        out = T.match_buffer(out_handle, (n, heads, head_dim), dtype)
        for task in T.parallel(n * heads):
            with T.sblock("attend"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((head_dim,), "float32")
                part = T.sblock_alloc_buffer((lanes,), "float32")
                state = T.sblock_alloc_buffer((4,), "float32")  # running max, denominator, score, new max
                owner = T.sblock_alloc_buffer((1,), "int64")
                row: T.let[T.int64] = task // heads
                h: T.let[T.int64] = task % heads
                kvh: T.let[T.int64] = h // group
                owner[0] = T.int64(-1)
                for b in T.serial(num_seqs):
                    if starts[b] <= row and row < starts[b + 1]:
                        owner[0] = b
                for d in T.vectorized(head_dim):
                    acc[d] = T.float32(0)
                if owner[0] >= 0:
                    seq: T.let[T.int64] = owner[0]
                    position: T.let[T.int64] = (
                        lens[seq] - (starts[seq + 1] - starts[seq]) + (row - starts[seq])
                    )
                    lowest: T.let[T.int64] = T.max(T.int64(0), position - T.int64(window) + T.int64(1))
                    state[0] = T.float32(-3.0e38)
                    state[1] = T.float32(0)
                    for t in T.serial(lowest, position + 1):
                        page: T.let[T.int64] = tables[seq, t // block_size]
                        offset: T.let[T.int64] = t % block_size
                        for lane in T.vectorized(lanes):
                            part[lane] = T.float32(0)
                        for c in T.serial(chunks):
                            for lane in T.vectorized(lanes):
                                part[lane] = part[lane] + T.Cast(
                                    "float32", q[row, h, c * lanes + lane]
                                ) * T.Cast("float32", cache[layer, 0, page, offset, kvh, c * lanes + lane])
                        state[2] = T.float32(0)
                        for lane in T.serial(lanes):
                            state[2] = state[2] + part[lane]
                        state[2] = state[2] * T.float32(scale)
                        state[3] = T.max(state[0], state[2])
                        for d in T.vectorized(head_dim):
                            acc[d] = acc[d] * T.exp(state[0] - state[3]) + T.exp(
                                state[2] - state[3]
                            ) * T.Cast("float32", cache[layer, 1, page, offset, kvh, d])
                        state[1] = state[1] * T.exp(state[0] - state[3]) + T.exp(state[2] - state[3])
                        state[0] = state[3]
                    for d in T.vectorized(head_dim):
                        out[row, h, d] = T.Cast(dtype, acc[d] / state[1])
                else:
                    for d in T.vectorized(head_dim):
                        out[row, h, d] = T.Cast(dtype, T.float32(0))

    return attention
