"""Paged attention on the CPU as TIR: write this step's K/V into the cache, then attend in tiles.

The cache is the runtime's [layers, 2, blocks, block_size, kv_heads, head_dim] tensor, written in
place (Relax `call_tir_inplace`). One parallel task attends a tile of up to `rows` consecutive query
rows with one KV head: the tile's rows of one sequence and the head's `group` query heads make the
task's score rows, and the task walks the keys they see in blocks of KEYS, at multiples of KEYS:

    scores[s, i]  = sum_d query[s, d] * K[first + i, d]
    online softmax per score row: a keys-wide max, exp (fast_exp.py, vectorized) and sum; keys the
                    row may not see (causal, sliding window, past the sequence) get probability 0
    acc[s, :]     = acc[s, :] * rescale + sum_i p[s, i] * V[first + i, :]

so each K/V element loaded serves every score row of the tile. The scores are a small GEMM: the
block's keys are transposed once (8 x 8 in registers) and fill the lanes, each query value
broadcast, SCORE_ROWS rows a register block, for a prefill tile and a decode row alike. Each score is
one chain of multiply-adds over d and the key blocks do not depend on the tile, so a row's result
is bit-for-bit the same whatever else is in its tile or batch. Rows outside every
sequence (the executable's padding) get zeros before the parallel loop, which has tasks for real
tiles only. Tasks alternate between early tiles (few keys under the causal mask) and late ones, so
the parallel runtime's contiguous ranges of tasks carry similar work.

Keys also go in segments of SEGMENT at multiples of SEGMENT: a score row's softmax state restarts
in each and the segments' states are merged in order. A short step with long sequences (decode)
splits each tile's segments over several tasks, which store their states; a second parallel loop
merges them with the same macro in the same order, so the split changes no bits.
"""

from __future__ import annotations

import math
from typing import Any

from tvm import tirx
from tvm.script import tirx as T

from kiln.backends.tvm.kernels.fast_exp import fast_exp
from kiln.backends.tvm.kernels.kv_format import FP8, loaded, stored

KEYS = 16  # keys a block: the lanes of a score vector
SCORE_ROWS = 4  # score rows computed together, their key vectors held in registers
SPAN_FLOOR = 16  # a tile's rows are at least this many (or `rows`) however short the step
SEGMENT = 256  # keys a segment: each score row's softmax state restarts there and is merged in order
MIN_TASKS = 16  # a step with fewer tiles x KV heads splits each tile's segments over several tasks
SPLIT_SEGMENTS = 4  # and each such task takes at least this many (under 1,024 keys a split costs more)
Expr = Any  # a TIR expression
CACHE_LINE = 64  # bytes


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


def tile_rows(group: int, head_dim: int) -> int:
    """The most query rows a task takes: up to 64, with the tile's queries and accumulators (2 x rows x
    group x head_dim floats) within 96 KiB. Each K/V block is loaded and transposed once for all of
    them: at 6,000 keys, tiles of 64 rows of SmolLM2 (3 heads a group) against 16: 1.5x on Zen 3.
    A short step takes fewer rows a tile (`span`), so that its tiles still spread over the cores."""
    return max(1, min(64, 12288 // (group * head_dim)))


def attention_kernel(
    heads: int,
    kv_heads: int,
    head_dim: int,
    scale: float,
    sliding_window: int | None,
    dtype: str,
    cache_dtype: str | None = None,
) -> tirx.PrimFunc:
    """`cache_dtype` as in kv_write_kernel."""
    cache_dtype = cache_dtype or dtype
    group = heads // kv_heads
    rows = tile_rows(group, head_dim)
    sub = SCORE_ROWS
    padded = -(-rows * group // sub) * sub  # score rows, whole register blocks
    part = math.gcd(head_dim, 64)  # accumulator floats a row keeps in registers while adding up V
    window = sliding_window or (1 << 62)  # no window: every earlier position is visible
    keys = KEYS
    per_line = CACHE_LINE // (1 if cache_dtype == FP8 else 2 if "16" in cache_dtype else 4)  # elements

    @T.macro
    def register_gemm(acc, broadcast, first, vectors):
        # acc[u, v] = sum over d of broadcast[first + u, d] * vectors[d, v], acc held in registers
        for u in T.unroll(acc.shape[0]):
            for v in T.vectorized(acc.shape[1]):
                acc[u, v] = T.float32(0)
        for d in T.serial(head_dim):
            for u in T.unroll(acc.shape[0]):
                for v in T.vectorized(acc.shape[1]):
                    acc[u, v] = acc[u, v] + broadcast[first + u, d] * vectors[d, v]

    @T.macro
    def fold(tree, scores, s, maximum, start):
        # tree[0] = the max or sum of start and scores[s, :]: the halves' lanes, then a chain
        for i in T.vectorized(keys // 2):
            tree[i] = _combine(scores[s, i], scores[s, i + keys // 2], maximum)
        tree[0] = _combine(start, tree[0], maximum)
        for i in T.serial(1, keys // 2):
            tree[0] = _combine(tree[0], tree[i], maximum)

    @T.macro
    def merge(total, merged, s, peak, denominator, source):
        # score row s: (total[s, 0] max, total[s, 1] sum, merged[s, :]) merged with a segment's
        # (peak, denominator, source[s, :]); one macro for both phases, so the same arithmetic
        both: T.let[T.float32] = T.max(total[s, 0], peak)
        earlier: T.let[T.float32] = fast_exp(total[s, 0] - both)
        total[s, 2] = fast_exp(peak - both)
        total[s, 1] = total[s, 1] * earlier + denominator * total[s, 2]
        for d in T.vectorized(head_dim):
            merged[s, d] = merged[s, d] * earlier + source[s, d] * total[s, 2]
        total[s, 0] = both

    @T.macro
    def start_merge(total, merged, count):
        for s in T.serial(count * group):
            total[s, 0] = T.float32(-3.0e38)
            total[s, 1] = T.float32(0)
            for d in T.vectorized(head_dim):
                merged[s, d] = T.float32(0)

    @T.macro
    def write_rows(out, lo, count, kvh, total, merged):
        for r in T.serial(count):
            for g in T.serial(group):
                for d in T.vectorized(head_dim):
                    out[lo + r, kvh * group + g, d] = T.Cast(
                        dtype, merged[r * group + g, d] / total[r * group + g, 1]
                    )

    @T.macro
    def attend_run(seq, lo, hi, kvh, layer, k_scale, v_scale, block_size, inputs, blocks, rows_state, split):
        # rows [lo, hi) of sequence `seq` with kv head `kvh`: this task's share of their segments
        q, cache, tables, lens, starts, out, states = inputs
        key_rows, key_t, value, block, tree, added = blocks  # one key block's
        query, acc, scores, running, total, merged = rows_state  # the run's score rows'
        share, parts, state_base, state_rows = split  # this task's part of `parts`; where it stores
        count: T.let[T.int64] = hi - lo
        first_position: T.let[T.int64] = lens[seq] - (starts[seq + 1] - starts[seq]) + (lo - starts[seq])
        last_position: T.let[T.int64] = first_position + count - 1
        lowest: T.let[T.int64] = T.max(T.int64(0), first_position - T.int64(window) + T.int64(1))
        segment_first: T.let[T.int64] = lowest // SEGMENT
        per_part: T.let[T.int64] = (last_position // SEGMENT - segment_first + parts) // parts
        mine_first: T.let[T.int64] = segment_first + share * per_part
        mine_end: T.let[T.int64] = T.min(mine_first + per_part, last_position // SEGMENT + 1)
        for r in T.serial(count):
            for g in T.serial(group):
                for d in T.vectorized(head_dim):
                    query[r * group + g, d] = T.Cast("float32", q[lo + r, kvh * group + g, d]) * T.float32(
                        scale
                    )
        # the score rows a register block reads past the run's: zeros
        for s in T.serial(count * group, (count * group + sub - 1) // sub * sub):
            for d in T.vectorized(head_dim):
                query[s, d] = T.float32(0)
        start_merge(total, merged, count)
        for segment in T.serial(mine_first, T.max(mine_first, mine_end)):
            for s in T.serial(count * group):
                for d in T.vectorized(head_dim):
                    acc[s, d] = T.float32(0)
                running[s, 0] = T.float32(-3.0e38)
                running[s, 1] = T.float32(0)
            # blocks start at multiples of KEYS and segments at multiples of SEGMENT, whatever the
            # tile: the same sums for a row
            block_from: T.let[T.int64] = T.max(segment * SEGMENT, lowest // keys * keys)
            block_last: T.let[T.int64] = T.min(segment * SEGMENT + SEGMENT - 1, last_position)
            for c in T.serial(block_last // keys - block_from // keys + 1):
                first: T.let[T.int64] = block_from + c * keys
                for i in T.serial(keys):
                    # past the last key: the last key again, which no row of the run sees
                    key: T.let[T.int64] = T.min(first + i, last_position)
                    page: T.let[T.int64] = tables[seq, key // block_size]
                    offset: T.let[T.int64] = key % block_size
                    # the next block's rows, which a long context's cache holds in memory, not in cache
                    ahead: T.let[T.int64] = T.min(first + keys + i, last_position)
                    for line in T.serial(-(-head_dim // per_line)):
                        for kv in T.serial(2):
                            T.evaluate(
                                _prefetch(
                                    T.address_of(
                                        cache[
                                            layer,
                                            kv,
                                            tables[seq, ahead // block_size],
                                            ahead % block_size,
                                            kvh,
                                            line * per_line,
                                        ]
                                    )
                                )
                            )
                    for d in T.vectorized(head_dim):
                        key_rows[i, d] = loaded(
                            cache[layer, 0, page, offset, kvh, d],
                            cache_dtype,
                            k_scale,
                        )
                    for d in T.vectorized(head_dim):
                        value[i, d] = loaded(
                            cache[layer, 1, page, offset, kvh, d],
                            cache_dtype,
                            v_scale,
                        )
                if head_dim % 8 == 0:
                    for i8 in T.serial(keys // 8):
                        for d8 in T.serial(head_dim // 8):
                            key_t[d8 * 8 + 0, T.ramp(i8 * 8, 1, 8)] = _transposed(key_rows, i8 * 8, d8 * 8, 0)
                            key_t[d8 * 8 + 1, T.ramp(i8 * 8, 1, 8)] = _transposed(key_rows, i8 * 8, d8 * 8, 1)
                            key_t[d8 * 8 + 2, T.ramp(i8 * 8, 1, 8)] = _transposed(key_rows, i8 * 8, d8 * 8, 2)
                            key_t[d8 * 8 + 3, T.ramp(i8 * 8, 1, 8)] = _transposed(key_rows, i8 * 8, d8 * 8, 3)
                            key_t[d8 * 8 + 4, T.ramp(i8 * 8, 1, 8)] = _transposed(key_rows, i8 * 8, d8 * 8, 4)
                            key_t[d8 * 8 + 5, T.ramp(i8 * 8, 1, 8)] = _transposed(key_rows, i8 * 8, d8 * 8, 5)
                            key_t[d8 * 8 + 6, T.ramp(i8 * 8, 1, 8)] = _transposed(key_rows, i8 * 8, d8 * 8, 6)
                            key_t[d8 * 8 + 7, T.ramp(i8 * 8, 1, 8)] = _transposed(key_rows, i8 * 8, d8 * 8, 7)
                else:
                    for i in T.serial(keys):
                        for d in T.serial(head_dim):
                            key_t[d, i] = key_rows[i, d]
                for b in T.serial((count * group + sub - 1) // sub):
                    register_gemm(block, query, b * sub, key_t)
                    for u in T.unroll(sub):
                        for i in T.vectorized(keys):
                            scores[b * sub + u, i] = block[u, i]
                for s in T.serial(count * group):
                    # the block's keys this row sees are i in [seen_from, seen_to]
                    seen_to: T.let[T.int32] = T.Cast(
                        "int32", T.min(first_position + s // group - first, T.int64(keys))
                    )
                    seen_from: T.let[T.int32] = T.Cast(
                        "int32",
                        T.max(
                            first_position + s // group - first - T.int64(window) + 1,
                            T.int64(-1),
                        ),
                    )
                    for i in T.vectorized(keys):
                        scores[s, i] = T.Select(
                            T.And(i >= seen_from, i <= seen_to),
                            scores[s, i],
                            T.float32(-3.0e38),
                        )
                    fold(tree, scores, s, True, running[s, 0])
                    peak: T.let[T.float32] = tree[0]
                    running[s, 2] = fast_exp(running[s, 0] - peak)
                    running[s, 0] = peak
                    for i in T.vectorized(keys):
                        scores[s, i] = T.Select(
                            T.And(i >= seen_from, i <= seen_to),
                            fast_exp(scores[s, i] - peak),
                            T.float32(0),
                        )
                    fold(tree, scores, s, False, running[s, 1] * running[s, 2])
                    running[s, 1] = tree[0]
                    for h in T.serial(head_dim // part):
                        for d in T.vectorized(part):
                            added[d] = acc[s, h * part + d] * running[s, 2]
                        for i in T.serial(keys):
                            for d in T.vectorized(part):
                                added[d] = added[d] + scores[s, i] * value[i, h * part + d]
                        for d in T.vectorized(part):
                            acc[s, h * part + d] = added[d]
            if parts == 1:
                for s in T.serial(count * group):
                    merge(total, merged, s, running[s, 0], running[s, 1], acc)
            else:
                for s in T.serial(count * group):
                    row: T.let[T.int64] = (state_base + segment - segment_first) * state_rows + s
                    states[row, 0] = running[s, 0]
                    states[row, 1] = running[s, 1]
                    for d in T.vectorized(head_dim):
                        states[row, 2 + d] = acc[s, d]
        if parts == 1:
            write_rows(out, lo, count, kvh, total, merged)

    @T.macro
    def merge_run(seq, lo, hi, kvh, inputs, rows_state, state_base, state_rows):
        # the split form's second phase: the segments' states in order, as attend_run merges them
        lens, starts, out, states = inputs
        acc, running, total, merged = rows_state
        count: T.let[T.int64] = hi - lo
        first_position: T.let[T.int64] = lens[seq] - (starts[seq + 1] - starts[seq]) + (lo - starts[seq])
        last_position: T.let[T.int64] = first_position + count - 1
        lowest: T.let[T.int64] = T.max(T.int64(0), first_position - T.int64(window) + T.int64(1))
        start_merge(total, merged, count)
        for segment in T.serial(last_position // SEGMENT - lowest // SEGMENT + 1):
            for s in T.serial(count * group):
                row: T.let[T.int64] = (state_base + segment) * state_rows + s
                running[s, 0] = states[row, 0]
                running[s, 1] = states[row, 1]
                for d in T.vectorized(head_dim):
                    acc[s, d] = states[row, 2 + d]
                merge(total, merged, s, running[s, 0], running[s, 1], acc)
        write_rows(out, lo, count, kvh, total, merged)

    @T.macro
    def locate(tile, span, starts, num_seqs, found):
        # found = (sequence, first row, end row) of `tile`
        found[0] = T.int64(0)  # tiles before the sequence's
        for seq in T.serial(num_seqs):
            begin: T.let[T.int64] = starts[seq]
            end: T.let[T.int64] = starts[seq + 1]
            own: T.let[T.int64] = (end - begin + span - 1) // span
            if found[0] <= tile and tile < found[0] + own:
                found[1] = seq
                found[2] = begin + (tile - found[0]) * span
                found[3] = T.min(found[2] + span, end)
            found[0] = found[0] + own

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
        # tiles of `span` rows: up to `rows`, fewer for a short step so that there are 8 tiles or more
        span: T.let[T.int64] = T.max(T.int64(min(rows, SPAN_FLOOR)), T.min(T.int64(rows), n // 8))
        # the rows after the sequences' (the executable's padding): zeros, here, so that every task
        # is real work (TVM's parallel loop gives each thread a contiguous range of tasks)
        for r in T.serial(starts[num_seqs], n):
            for h in T.serial(heads):
                for d in T.vectorized(head_dim):
                    out[r, h, d] = T.Cast(dtype, T.float32(0))
        # each sequence's rows in tiles; the most segments a sequence has
        sizes = T.alloc_buffer((2,), "int64")
        sizes[0] = T.int64(0)
        sizes[1] = T.int64(0)
        for seq in T.serial(num_seqs):
            sizes[0] = sizes[0] + (starts[seq + 1] - starts[seq] + span - 1) // span
        for seq in T.serial(num_seqs):
            sizes[1] = T.max(sizes[1], (lens[seq] + SEGMENT - 1) // SEGMENT)
        tiles: T.let[T.int64] = sizes[0]
        # a short step (decode) with long sequences splits each tile's segments over `parts` tasks,
        # so that the cores share even one sequence's keys; their states go to `states`, merged in
        # order by a second loop
        parts: T.let[T.int64] = T.if_then_else(
            n * kv_heads < MIN_TASKS * span,  # as `states` is sized
            T.max(
                T.int64(1),
                T.min(
                    (T.int64(MIN_TASKS) + tiles * kv_heads - 1) // T.max(tiles * kv_heads, T.int64(1)),
                    sizes[1] // SPLIT_SEGMENTS,
                ),
            ),
            T.int64(1),
        )
        state_rows: T.let[T.int64] = span * group
        # sized from the arguments' shapes only (TVM allocates at the function's top): a step splits
        # only if n * kv_heads < MIN_TASKS * span and it has fewer than MIN_TASKS tiles x heads, each
        # at most `segments` segments
        segments: T.let[T.int64] = (max_blocks * block_size + SEGMENT - 1) // SEGMENT
        states = T.alloc_buffer(
            (
                T.if_then_else(
                    n * kv_heads
                    < MIN_TASKS * T.max(T.int64(min(rows, SPAN_FLOOR)), T.min(T.int64(rows), n // 8)),
                    MIN_TASKS
                    * ((max_blocks * block_size + SEGMENT - 1) // SEGMENT)
                    * T.max(T.int64(min(rows, SPAN_FLOOR)), T.min(T.int64(rows), n // 8))
                    * group,
                    T.int64(1),
                ),
                head_dim + 2,
            ),
            "float32",
        )
        for task in T.parallel(tiles * kv_heads * parts):
            with T.sblock("attend"):
                T.reads()
                T.writes()
                query = T.sblock_alloc_buffer((padded, head_dim), "float32")
                acc = T.sblock_alloc_buffer((padded, head_dim), "float32")
                merged = T.sblock_alloc_buffer((padded, head_dim), "float32")
                key_rows = T.sblock_alloc_buffer((keys, head_dim), "float32")
                key_t = T.sblock_alloc_buffer((head_dim, keys), "float32")
                value = T.sblock_alloc_buffer((keys, head_dim), "float32")
                scores = T.sblock_alloc_buffer((padded, keys), "float32")
                block = T.sblock_alloc_buffer((sub, keys), "float32")
                tree = T.sblock_alloc_buffer((keys,), "float32")
                added = T.sblock_alloc_buffer((part,), "float32")
                # a segment's max, denominator, the rescale of what came before; the merged ones
                running = T.sblock_alloc_buffer((padded, 3), "float32")
                total = T.sblock_alloc_buffer((padded, 3), "float32")
                found = T.sblock_alloc_buffer((4,), "int64")
                share: T.let[T.int64] = task % parts
                slot: T.let[T.int64] = task // parts // kv_heads
                kvh: T.let[T.int64] = task // parts % kv_heads
                tile: T.let[T.int64] = T.if_then_else(slot % 2 == 0, slot // 2, tiles - 1 - slot // 2)
                locate(tile, span, starts, num_seqs, found)
                inputs = (q, cache, tables, lens, starts, out, states)
                blocks = (key_rows, key_t, value, block, tree, added)
                rows_state = (query, acc, scores, running, total, merged)
                split = (share, parts, (tile * kv_heads + kvh) * segments, state_rows)
                attend_run(
                    found[1],
                    found[2],
                    found[3],
                    kvh,
                    layer,
                    k_scale,
                    v_scale,
                    block_size,
                    inputs,
                    blocks,
                    rows_state,
                    split,
                )
        if parts > 1:
            for task in T.parallel(tiles * kv_heads):
                with T.sblock("merge"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((padded, head_dim), "float32")
                    merged = T.sblock_alloc_buffer((padded, head_dim), "float32")
                    running = T.sblock_alloc_buffer((padded, 3), "float32")
                    total = T.sblock_alloc_buffer((padded, 3), "float32")
                    found = T.sblock_alloc_buffer((4,), "int64")
                    tile: T.let[T.int64] = task // kv_heads
                    kvh: T.let[T.int64] = task % kv_heads
                    locate(tile, span, starts, num_seqs, found)
                    merge_run(
                        found[1],
                        found[2],
                        found[3],
                        kvh,
                        (lens, starts, out, states),
                        (acc, running, total, merged),
                        (tile * kv_heads + kvh) * segments,
                        state_rows,
                    )

    return attention


def _combine(a: Expr, b: Expr, maximum: bool) -> Expr:
    return T.max(a, b) if maximum else a + b


def _prefetch(address: Expr) -> Expr:
    """LLVM's prefetch of the cache line at `address`: a read, kept in every cache level, data."""
    return T.call_llvm_intrin("void", "llvm.prefetch.p0", address, T.int32(0), T.int32(3), T.int32(1))


_UNPACK = ([0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15])  # unpcklps, unpckhps
_PAIRS = ([0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])  # shufps
_HALVES = ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])  # vperm2f128


def _transposed(rows: Any, row0: Expr, column0: Expr, j: int) -> Expr:
    """Column `column0 + j` of the 8 x 8 block rows[row0 : row0 + 8, column0 : column0 + 8] as 8 floats:
    three rounds of two-vector shuffles, which LLVM makes unpck / shufps / vperm2f128 on x86 (zip /
    trn on aarch64). The eight columns share their intermediate vectors, which LLVM computes once."""

    def row(i: int) -> Expr:
        return rows.vload([row0 + i, column0], "float32x8")

    def unpacked(pair: int, high: int) -> Expr:  # rows 2 pair, 2 pair + 1 interleaved
        return T.Shuffle([row(2 * pair), row(2 * pair + 1)], _UNPACK[high])

    def paired(quad: int, high: int, upper: int) -> Expr:  # rows 4 quad .. 4 quad + 3
        return T.Shuffle([unpacked(2 * quad, high), unpacked(2 * quad + 1, high)], _PAIRS[upper])

    high, upper, second = (j >> 1) & 1, j & 1, j >> 2
    return T.Shuffle([paired(0, high, upper), paired(1, high, upper)], _HALVES[second])
