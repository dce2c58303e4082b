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

from kiln.backends.tvm.kernels.kv_format import FP8, loaded, stored

CHUNK = 16  # keys scored before each rescale of the running sums


def _lanes(head_dim: int) -> int:
    return math.gcd(head_dim, 16)


def kv_write_kernel(
    kv_heads: int, head_dim: int, dtype: str, cache_dtype: str | None = None
) -> tirx.PrimFunc:
    """`cache_dtype` (default `dtype`): float8_e4m3fn stores K / k_scale and V / v_scale (kv_format.py)."""
    cache_dtype = cache_dtype or dtype
    # TVM's float8 legalization does not vectorize (a scalar if_then_else per element)
    dims = T.serial if cache_dtype == FP8 else T.vectorized

    @T.prim_func(s_tir=True)
    def kv_write(
        k_handle: T.handle,
        v_handle: T.handle,
        cache_handle: T.handle,
        slot_handle: T.handle,
        layer: T.int64,
        k_scale: T.float32,
        v_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int64()
        num_layers = T.int64()
        num_blocks = T.int64()
        block_size = T.int64()
        k = T.match_buffer(k_handle, (n, kv_heads, head_dim), dtype)
        v = T.match_buffer(v_handle, (n, kv_heads, head_dim), dtype)
        cache = T.match_buffer(
            cache_handle, (num_layers, 2, num_blocks, block_size, kv_heads, head_dim), cache_dtype
        )
        slots = T.match_buffer(slot_handle, (n,), "int64")
        for row in T.serial(n):
            with T.sblock("write"):
                T.reads()
                T.writes()
                slot: T.let[T.int64] = slots[row]
                if slot >= 0:
                    for h in T.serial(kv_heads):
                        for d in dims(head_dim):
                            cache[layer, 0, slot // block_size, slot % block_size, h, d] = stored(
                                k[row, h, d], cache_dtype, k_scale
                            )
                            cache[layer, 1, slot // block_size, slot % block_size, h, d] = stored(
                                v[row, h, d], cache_dtype, v_scale
                            )

    return kv_write


def attention_kernel(
    heads: int,
    kv_heads: int,
    head_dim: int,
    scale: float,
    sliding_window: int | None,
    dtype: str,
    cache_dtype: str | None = None,
) -> tirx.PrimFunc:
    """One parallel task per (query row, kv head): the group's query heads share each K/V load. Keys go
    in chunks of CHUNK: scores for the chunk, one rescale of the running sums, then the weighted V.
    `cache_dtype` as in kv_write_kernel."""
    cache_dtype = cache_dtype or dtype
    group = heads // kv_heads
    lanes = _lanes(head_dim)
    chunks = head_dim // lanes
    window = sliding_window or (1 << 62)  # no window: every earlier position is visible
    chunk = CHUNK

    @T.prim_func(s_tir=True)
    def attention(
        q_handle: T.handle,
        cache_handle: T.handle,
        tables_handle: T.handle,
        lens_handle: T.handle,
        starts_handle: T.handle,
        layer: T.int64,
        k_scale: T.float32,
        v_scale: T.float32,
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
            cache_handle, (num_layers, 2, num_blocks, block_size, kv_heads, head_dim), cache_dtype
        )
        tables = T.match_buffer(tables_handle, (num_seqs, max_blocks), "int64")
        lens = T.match_buffer(lens_handle, (num_seqs,), "int64")
        starts = T.match_buffer(starts_handle, (num_starts,), "int64")
        out = T.match_buffer(out_handle, (n, heads, head_dim), dtype)
        for task in T.parallel(n * kv_heads):
            with T.sblock("attend"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((group, head_dim), "float32")
                query = T.sblock_alloc_buffer((group, head_dim), "float32")
                part = T.sblock_alloc_buffer((lanes,), "float32")
                scores = T.sblock_alloc_buffer((group, chunk), "float32")
                # max, denominator, new max, the rescale of what came before
                running = T.sblock_alloc_buffer((group, 4), "float32")
                owner = T.sblock_alloc_buffer((1,), "int64")
                row: T.let[T.int64] = task // kv_heads
                kvh: T.let[T.int64] = task % kv_heads
                owner[0] = T.int64(-1)
                for b in T.serial(num_seqs):
                    if starts[b] <= row and row < starts[b + 1]:
                        owner[0] = b
                for g in T.serial(group):
                    for d in T.vectorized(head_dim):
                        acc[g, d] = T.float32(0)
                        query[g, d] = T.Cast("float32", q[row, kvh * group + g, d]) * T.float32(scale)
                    running[g, 0] = T.float32(-3.0e38)
                    running[g, 1] = T.float32(0)
                if owner[0] >= 0:
                    seq: T.let[T.int64] = owner[0]
                    position: T.let[T.int64] = (
                        lens[seq] - (starts[seq + 1] - starts[seq]) + (row - starts[seq])
                    )
                    lowest: T.let[T.int64] = T.max(T.int64(0), position - T.int64(window) + T.int64(1))
                    for c in T.serial((position + 1 - lowest + chunk - 1) // chunk):
                        first: T.let[T.int64] = lowest + c * chunk
                        count: T.let[T.int64] = T.min(T.int64(chunk), position + 1 - first)
                        for i in T.serial(count):
                            page: T.let[T.int64] = tables[seq, (first + i) // block_size]
                            offset: T.let[T.int64] = (first + i) % block_size
                            for g in T.serial(group):
                                for lane in T.vectorized(lanes):
                                    part[lane] = T.float32(0)
                                for ci in T.serial(chunks):
                                    for lane in T.vectorized(lanes):
                                        part[lane] = part[lane] + query[g, ci * lanes + lane] * loaded(
                                            cache[layer, 0, page, offset, kvh, ci * lanes + lane],
                                            cache_dtype,
                                            k_scale,
                                        )
                                # a tree of halving vector adds, not a chain of `lanes` dependent adds
                                if lanes == 16:
                                    for lane in T.vectorized(8):
                                        part[lane] = part[lane] + part[lane + 8]
                                if lanes >= 8:
                                    for lane in T.vectorized(4):
                                        part[lane] = part[lane] + part[lane + 4]
                                if lanes >= 4:
                                    for lane in T.vectorized(2):
                                        part[lane] = part[lane] + part[lane + 2]
                                scores[g, i] = part[0] + part[1]
                        for g in T.serial(group):
                            running[g, 2] = running[g, 0]
                            for i in T.serial(count):
                                running[g, 2] = T.max(running[g, 2], scores[g, i])
                            running[g, 3] = T.exp(running[g, 0] - running[g, 2])  # once, not a lane
                            for d in T.vectorized(head_dim):
                                acc[g, d] = acc[g, d] * running[g, 3]
                            running[g, 1] = running[g, 1] * running[g, 3]
                            running[g, 0] = running[g, 2]
                            for i in T.serial(count):
                                scores[g, i] = T.exp(scores[g, i] - running[g, 0])
                                running[g, 1] = running[g, 1] + scores[g, i]
                        for i in T.serial(count):
                            page: T.let[T.int64] = tables[seq, (first + i) // block_size]
                            offset: T.let[T.int64] = (first + i) % block_size
                            for g in T.serial(group):
                                for d in T.vectorized(head_dim):
                                    acc[g, d] = acc[g, d] + scores[g, i] * loaded(
                                        cache[layer, 1, page, offset, kvh, d], cache_dtype, v_scale
                                    )
                    for g in T.serial(group):
                        for d in T.vectorized(head_dim):
                            out[row, kvh * group + g, d] = T.Cast(dtype, acc[g, d] / running[g, 1])
                else:
                    for g in T.serial(group):
                        for d in T.vectorized(head_dim):
                            out[row, kvh * group + g, d] = T.Cast(dtype, T.float32(0))

    return attention
