"""Paged attention on an NVIDIA GPU as TIR: the same buffers and semantics as attention.py, GPU threads.

kv_write: one thread block per token row, its threads over (kv head, dim); rows whose slot is < 0
(the executable's padding) write nothing.

attention: one thread block per (query row, head). The row's visible keys (its sequence's keys up to
its own position, within the sliding window) are dealt round-robin to the block's threads; each
thread keeps an online softmax (running max, denominator, float32 accumulator over head_dim) for its
keys; the block then merges the per-thread states through shared memory. Grouped-query heads read
their kv head `h // (heads // kv_heads)`. Rows outside every sequence get zeros. A row's result
depends only on its own keys, never on the rest of the batch. With `visible_ends` the kernel takes
`ends` [n] after `starts`, and row r's keys go up to ends[r] - 1 instead of its own position.
"""

from __future__ import annotations

from typing import Any

from tvm import tirx
from tvm.script import tirx as T
from tvm.tirx import Buffer

from kiln.backends.tvm.kernels.attention import without_param
from kiln.backends.tvm.kernels.kv_format import loaded, stored

Expr = Any  # a TIR expression

WRITE_THREADS = 256
NEG_INF = -3.0e38


def attention_threads(head_dim: int) -> int:
    """Threads per (row, head) block: the merge buffer [threads, head_dim] float32 stays <= 32 KiB."""
    for threads in (128, 64, 32):
        if threads * head_dim * 4 <= 32 * 1024:
            return threads
    return 32


def kv_write_kernel(
    kv_heads: int, head_dim: int, dtype: str, cache_dtype: str | None = None
) -> tirx.PrimFunc:
    """`cache_dtype` (default `dtype`): float8_e4m3fn stores K / k_scale and V / v_scale (kv_format.py)."""
    cache_dtype = cache_dtype or dtype
    width = kv_heads * head_dim
    threads = min(WRITE_THREADS, width)
    steps = -(-width // threads)

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
        for row in T.thread_binding(n, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                with T.sblock("write"):
                    T.reads()
                    T.writes()
                    slot: T.let[T.int64] = slots[row]
                    for step in T.serial(steps):
                        e: T.let[T.int64] = T.int64(step * threads) + T.Cast("int64", tx)
                        if slot >= 0 and e < T.int64(width):
                            page: T.let[T.int64] = slot // block_size
                            offset: T.let[T.int64] = slot % block_size
                            kvh: T.let[T.int64] = e // head_dim
                            d: T.let[T.int64] = e % head_dim
                            cache[layer, 0, page, offset, kvh, d] = stored(
                                k[row, kvh, d], cache_dtype, k_scale, native=True
                            )
                            cache[layer, 1, page, offset, kvh, d] = stored(
                                v[row, kvh, d], cache_dtype, v_scale, native=True
                            )

    return kv_write


def _last_key(visible_ends: bool, ends: Buffer, row: Expr, position: Expr, context: Expr) -> Expr:
    """The last key query row `row` (at `position`) sees: itself, or the key before its end, within
    its sequence's `context` keys."""
    return T.min(ends[row], context) - 1 if visible_ends else position


def attention_kernel(
    heads: int,
    kv_heads: int,
    head_dim: int,
    scale: float,
    sliding_window: int | None,
    dtype: str,
    cache_dtype: str | None = None,
    visible_ends: bool = False,
) -> tirx.PrimFunc:
    """`cache_dtype` as in kv_write_kernel. `visible_ends`: the kernel takes `ends` [n] after `starts`
    (attention.py's kernel's arguments)."""
    cache_dtype = cache_dtype or dtype
    group = heads // kv_heads
    window = sliding_window or (1 << 62)  # no window: every earlier position is visible
    threads = attention_threads(head_dim)
    dim_steps = -(-head_dim // threads)

    @T.prim_func(s_tir=True)
    def attention(
        q_handle: T.handle,
        cache_handle: T.handle,
        tables_handle: T.handle,
        lens_handle: T.handle,
        starts_handle: T.handle,
        ends_handle: T.handle,
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
        ends = T.match_buffer(ends_handle, (n,), "int64")  # read only with visible_ends
        out = T.match_buffer(out_handle, (n, heads, head_dim), dtype)
        for task in T.thread_binding(n * heads, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                with T.sblock("attend"):
                    T.reads()
                    T.writes()
                    q_shared = T.sblock_alloc_buffer((head_dim,), "float32", scope="shared")
                    acc_shared = T.sblock_alloc_buffer((threads, head_dim), "float32", scope="shared")
                    max_shared = T.sblock_alloc_buffer((threads,), "float32", scope="shared")
                    sum_shared = T.sblock_alloc_buffer((threads,), "float32", scope="shared")
                    acc = T.sblock_alloc_buffer((head_dim,), "float32", scope="local")
                    # running max, denominator, score, new max, merged max, merged denominator, column
                    state = T.sblock_alloc_buffer((7,), "float32", scope="local")
                    owner = T.sblock_alloc_buffer((1,), "int64", scope="local")
                    row: T.let[T.int64] = task // heads
                    h: T.let[T.int64] = task % heads
                    kvh: T.let[T.int64] = h // group
                    owner[0] = T.int64(-1)
                    for b in T.serial(num_seqs):
                        if starts[b] <= row and row < starts[b + 1]:
                            owner[0] = b
                    for i in T.serial(dim_steps):
                        if i * threads + tx < head_dim:
                            scaled = T.Cast("float32", q[row, h, i * threads + tx]) * T.float32(scale)
                            q_shared[i * threads + tx] = scaled
                    for d in T.unroll(head_dim):
                        acc[d] = T.float32(0)
                    state[0] = T.float32(NEG_INF)
                    state[1] = T.float32(0)
                    T.tvm_storage_sync("shared")
                    if owner[0] >= 0:
                        seq: T.let[T.int64] = owner[0]
                        position: T.let[T.int64] = (
                            lens[seq] - (starts[seq + 1] - starts[seq]) + (row - starts[seq])
                        )
                        lowest: T.let[T.int64] = T.max(T.int64(0), position - T.int64(window) + T.int64(1))
                        rounds: T.let[T.int64] = (
                            _last_key(visible_ends, ends, row, position, lens[seq])
                            + T.int64(threads)
                            - lowest
                        ) // T.int64(threads)
                        for r in T.serial(rounds):
                            t: T.let[T.int64] = lowest + r * T.int64(threads) + T.Cast("int64", tx)
                            if t <= _last_key(visible_ends, ends, row, position, lens[seq]):
                                page: T.let[T.int64] = tables[seq, t // block_size]
                                offset: T.let[T.int64] = t % block_size
                                state[2] = T.float32(0)
                                for d in T.unroll(head_dim):
                                    state[2] = state[2] + q_shared[d] * loaded(
                                        cache[layer, 0, page, offset, kvh, d],
                                        cache_dtype,
                                        k_scale,
                                        native=True,
                                    )
                                state[3] = T.max(state[0], state[2])
                                for d in T.unroll(head_dim):
                                    acc[d] = acc[d] * T.exp(state[0] - state[3]) + T.exp(
                                        state[2] - state[3]
                                    ) * loaded(
                                        cache[layer, 1, page, offset, kvh, d],
                                        cache_dtype,
                                        v_scale,
                                        native=True,
                                    )
                                state[1] = state[1] * T.exp(state[0] - state[3]) + T.exp(state[2] - state[3])
                                state[0] = state[3]
                    max_shared[tx] = state[0]
                    sum_shared[tx] = state[1]
                    T.tvm_storage_sync("shared")
                    state[4] = T.float32(NEG_INF)
                    for j in T.serial(threads):
                        state[4] = T.max(state[4], max_shared[j])
                    for d in T.unroll(head_dim):
                        acc_shared[tx, d] = acc[d] * T.exp(state[0] - state[4])
                    state[5] = T.float32(0)
                    for j in T.serial(threads):
                        state[5] = state[5] + sum_shared[j] * T.exp(max_shared[j] - state[4])
                    T.tvm_storage_sync("shared")
                    for i in T.serial(dim_steps):
                        if i * threads + tx < head_dim:
                            state[6] = T.float32(0)
                            for j in T.serial(threads):
                                state[6] = state[6] + acc_shared[j, i * threads + tx]
                            if owner[0] >= 0:
                                out[row, h, i * threads + tx] = T.Cast(dtype, state[6] / state[5])
                            else:
                                out[row, h, i * threads + tx] = T.Cast(dtype, T.float32(0))

    return attention if visible_ends else without_param(attention, "ends")
