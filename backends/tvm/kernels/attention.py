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

With `visible_ends` (the op's 10th input: Gemma 3's images attend within themselves both ways) the
kernel takes one more buffer, `ends` [n]: row r sees keys up to ends[r] - 1 instead of its own
position. A tile then walks the keys up to the largest end of its rows (never past its sequence),
and each score row masks the keys past its own end, so a row's result still depends only on its
own position and end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tvm import tirx
from tvm.script import tirx as T
from tvm.tirx import Buffer

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


# The TIR macros below are module-level: each captures the module's globals defined above it when it
# is defined, so helpers come before the macros that use them.


# Tile choice: a task's tile of query rows and KV head, and how many tasks share its segments.


@dataclass(frozen=True)
class AttentionPlan:
    """One attention kernel's design (module docstring): tiles of up to `rows` query rows a task, whose
    `group` query heads a row make the task's score rows, against the cache's keys in blocks of KEYS."""

    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None
    dtype: str
    cache_dtype: str  # float8_e4m3fn stores K / k_scale and V / v_scale (kv_format.py)
    visible_ends: bool = False  # the kernel takes `ends` [n]: each row's keys end there, not at itself

    @property
    def group(self) -> int:  # query heads a KV head
        return self.heads // self.kv_heads

    @property
    def rows(self) -> int:  # the most query rows a tile
        return tile_rows(self.group, self.head_dim)

    @property
    def padded(self) -> int:  # score rows, whole register blocks
        return -(-self.rows * self.group // SCORE_ROWS) * SCORE_ROWS

    @property
    def value_part(self) -> int:  # accumulator floats a row keeps in registers while adding up V
        return math.gcd(self.head_dim, 64)

    @property
    def window(self) -> int:  # no window: every earlier position is visible
        return self.sliding_window or (1 << 62)

    @property
    def per_line(self) -> int:  # cache elements a cache line
        return CACHE_LINE // (1 if self.cache_dtype == FP8 else 2 if "16" in self.cache_dtype else 4)

    @property
    def found_size(self) -> int:
        """_locate's (tiles before, sequence, first row, end row), and _furthest_end's end."""
        return 5 if self.visible_ends else 4


def _last_key(first_position: Expr, count: Expr, tile_end: Expr | None) -> Expr:
    """The last key a tile's rows see: its last row's position, or the key before their furthest end."""
    return first_position + count - 1 if tile_end is None else tile_end - 1


def _row_last_key(plan: AttentionPlan, ends: Buffer, row: Expr, position: Expr, last_key: Expr) -> Expr:
    """The last key query row `row` (at `position`) sees: itself, or the key before its end (within
    the tile's keys, which never pass the sequence's)."""
    return T.min(ends[row] - 1, last_key) if plan.visible_ends else position


def _tile_end(plan: AttentionPlan, found: Buffer) -> Expr | None:
    """With visible_ends, the furthest end of the tile's rows (_furthest_end)."""
    return found[4] if plan.visible_ends else None


def _span(plan: AttentionPlan, n: Expr) -> Expr:
    """Rows a tile: up to `rows`, fewer for a short step so that there are 8 tiles or more."""
    return T.max(T.int64(min(plan.rows, SPAN_FLOOR)), T.min(T.int64(plan.rows), n // 8))


def _parts(plan: AttentionPlan, n: Expr, span: Expr, tiles: Expr, most_segments: Expr) -> Expr:
    """Tasks a tile's segments go over: several for a short step (decode) with long sequences, so that
    the cores share even one sequence's keys, else 1."""
    return T.if_then_else(
        n * plan.kv_heads < MIN_TASKS * span,  # as `states` is sized
        T.max(
            T.int64(1),
            T.min(
                (T.int64(MIN_TASKS) + tiles * plan.kv_heads - 1) // T.max(tiles * plan.kv_heads, T.int64(1)),
                most_segments // SPLIT_SEGMENTS,
            ),
        ),
        T.int64(1),
    )


def _states_capacity(plan: AttentionPlan, n: Expr, max_blocks: Expr, block_size: Expr) -> Expr:
    """Rows of the split form's `states`, sized from the arguments' shapes only (TVM allocates at the
    function's top): a step splits only if n * kv_heads < MIN_TASKS * span and it has fewer than
    MIN_TASKS tiles x heads, each at most `segments` segments."""
    return T.if_then_else(
        n * plan.kv_heads < MIN_TASKS * _span(plan, n),
        MIN_TASKS * ((max_blocks * block_size + SEGMENT - 1) // SEGMENT) * _span(plan, n) * plan.group,
        T.int64(1),
    )


@T.macro
def _tile_and_segment_counts(
    plan: AttentionPlan, sizes: Buffer, starts: Buffer, lens: Buffer, num_seqs: Expr, span: Expr
):
    # sizes = (the sequences' tiles, the most segments a sequence has: a tile's keys never pass its
    # sequence's, whatever its rows' ends)
    sizes[0] = T.int64(0)
    sizes[1] = T.int64(0)
    for seq in T.serial(num_seqs):
        sizes[0] = sizes[0] + (starts[seq + 1] - starts[seq] + span - 1) // span
    for seq in T.serial(num_seqs):
        sizes[1] = T.max(sizes[1], (lens[seq] + SEGMENT - 1) // SEGMENT)


@T.macro
def _locate(tile: Expr, span: Expr, starts: Buffer, num_seqs: Expr, found: Buffer):
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


@T.macro
def _furthest_end(ends: Buffer, lens: Buffer, found: Buffer):
    # found[4] = the largest end of the tile's rows found[2] .. found[3] - 1, within its sequence's keys
    found[4] = T.int64(0)
    for row in T.serial(found[2], found[3]):
        found[4] = T.max(found[4], ends[row])
    found[4] = T.min(found[4], lens[found[1]])


# Load: the run's queries, a block of keys and values (the keys transposed) from the paged cache.


def _prefetch(address: Expr) -> Expr:
    """LLVM's prefetch of the cache line at `address`: a read, kept in every cache level, data."""
    return T.call_llvm_intrin("void", "llvm.prefetch.p0", address, T.int32(0), T.int32(3), T.int32(1))


_UNPACK = ([0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15])  # unpcklps, unpckhps
_PAIRS = ([0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])  # shufps
_HALVES = ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])  # vperm2f128


def _transposed(rows: Buffer, row0: Expr, column0: Expr, j: int) -> Expr:
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


@T.macro
def _load_queries(plan: AttentionPlan, q: Buffer, lo: Expr, count: Expr, kvh: Expr, query: Buffer):
    # the run's score rows, row r's query heads at r * group .., scaled
    for r in T.serial(count):
        for g in T.serial(plan.group):
            for d in T.vectorized(plan.head_dim):
                query[r * plan.group + g, d] = T.Cast(
                    "float32", q[lo + r, kvh * plan.group + g, d]
                ) * T.float32(plan.scale)
    # the score rows a register block reads past the run's: zeros
    for s in T.serial(count * plan.group, (count * plan.group + SCORE_ROWS - 1) // SCORE_ROWS * SCORE_ROWS):
        for d in T.vectorized(plan.head_dim):
            query[s, d] = T.float32(0)


@T.macro
def _load_key_block(
    plan: AttentionPlan,
    cache: Buffer,
    tables: Buffer,
    seq: Expr,
    layer: Expr,
    kvh: Expr,
    block_size: Expr,
    first: Expr,
    last_key: Expr,
    scales: tuple,
    key_rows: Buffer,
    value: Buffer,
):
    # keys first .. first + KEYS - 1 as float32 rows (K and V), the next block's prefetched
    k_scale, v_scale = scales
    for i in T.serial(KEYS):
        # past the last key: the last key again, which no row of the run sees
        key: T.let[T.int64] = T.min(first + i, last_key)
        page: T.let[T.int64] = tables[seq, key // block_size]
        offset: T.let[T.int64] = key % block_size
        # the next block's rows, which a long context's cache holds in memory, not in cache
        ahead: T.let[T.int64] = T.min(first + KEYS + i, last_key)
        for line in T.serial(-(-plan.head_dim // plan.per_line)):
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
                                line * plan.per_line,
                            ]
                        )
                    )
                )
        for d in T.vectorized(plan.head_dim):
            key_rows[i, d] = loaded(
                cache[layer, 0, page, offset, kvh, d],
                plan.cache_dtype,
                k_scale,
            )
        for d in T.vectorized(plan.head_dim):
            value[i, d] = loaded(
                cache[layer, 1, page, offset, kvh, d],
                plan.cache_dtype,
                v_scale,
            )


@T.macro
def _transpose_keys(plan: AttentionPlan, key_rows: Buffer, key_t: Buffer):
    # key_t[d, i] = key_rows[i, d]: 8 x 8 blocks in registers where head_dim allows
    if plan.head_dim % 8 == 0:
        for i8 in T.serial(KEYS // 8):
            for d8 in T.serial(plan.head_dim // 8):
                key_t[d8 * 8 + 0, T.ramp(i8 * 8, 1, 8)] = _transposed(key_rows, i8 * 8, d8 * 8, 0)
                key_t[d8 * 8 + 1, T.ramp(i8 * 8, 1, 8)] = _transposed(key_rows, i8 * 8, d8 * 8, 1)
                key_t[d8 * 8 + 2, T.ramp(i8 * 8, 1, 8)] = _transposed(key_rows, i8 * 8, d8 * 8, 2)
                key_t[d8 * 8 + 3, T.ramp(i8 * 8, 1, 8)] = _transposed(key_rows, i8 * 8, d8 * 8, 3)
                key_t[d8 * 8 + 4, T.ramp(i8 * 8, 1, 8)] = _transposed(key_rows, i8 * 8, d8 * 8, 4)
                key_t[d8 * 8 + 5, T.ramp(i8 * 8, 1, 8)] = _transposed(key_rows, i8 * 8, d8 * 8, 5)
                key_t[d8 * 8 + 6, T.ramp(i8 * 8, 1, 8)] = _transposed(key_rows, i8 * 8, d8 * 8, 6)
                key_t[d8 * 8 + 7, T.ramp(i8 * 8, 1, 8)] = _transposed(key_rows, i8 * 8, d8 * 8, 7)
    else:
        for i in T.serial(KEYS):
            for d in T.serial(plan.head_dim):
                key_t[d, i] = key_rows[i, d]


# Inner product: a block's scores, each score row's online softmax, the values weighted by it.


def _combine(a: Expr, b: Expr, maximum: bool) -> Expr:
    return T.max(a, b) if maximum else a + b


@T.macro
def _register_gemm(plan: AttentionPlan, acc: Buffer, broadcast: Buffer, first: Expr, vectors: Buffer):
    # acc[u, v] = sum over d of broadcast[first + u, d] * vectors[d, v], acc held in registers
    for u in T.unroll(acc.shape[0]):
        for v in T.vectorized(acc.shape[1]):
            acc[u, v] = T.float32(0)
    for d in T.serial(plan.head_dim):
        for u in T.unroll(acc.shape[0]):
            for v in T.vectorized(acc.shape[1]):
                acc[u, v] = acc[u, v] + broadcast[first + u, d] * vectors[d, v]


@T.macro
def _block_scores(
    plan: AttentionPlan, count: Expr, query: Buffer, key_t: Buffer, block: Buffer, scores: Buffer
):
    # scores[s, i] = query[s, :] . key i, SCORE_ROWS score rows a register block
    for b in T.serial((count * plan.group + SCORE_ROWS - 1) // SCORE_ROWS):
        _register_gemm(plan, block, query, b * SCORE_ROWS, key_t)
        for u in T.unroll(SCORE_ROWS):
            for i in T.vectorized(KEYS):
                scores[b * SCORE_ROWS + u, i] = block[u, i]


@T.macro
def _start_segment(plan: AttentionPlan, count: Expr, acc: Buffer, running: Buffer):
    for s in T.serial(count * plan.group):
        for d in T.vectorized(plan.head_dim):
            acc[s, d] = T.float32(0)
        running[s, 0] = T.float32(-3.0e38)
        running[s, 1] = T.float32(0)


@T.macro
def _fold(tree: Buffer, scores: Buffer, s: Expr, maximum: bool, start: Expr):
    # tree[0] = the max or sum of start and scores[s, :]: the halves' lanes, then a chain
    for i in T.vectorized(KEYS // 2):
        tree[i] = _combine(scores[s, i], scores[s, i + KEYS // 2], maximum)
    tree[0] = _combine(start, tree[0], maximum)
    for i in T.serial(1, KEYS // 2):
        tree[0] = _combine(tree[0], tree[i], maximum)


@T.macro
def _softmax_row(
    plan: AttentionPlan,
    s: Expr,
    first_position: Expr,
    first: Expr,
    scores: Buffer,
    tree: Buffer,
    running: Buffer,
    ends: Buffer,
    lo: Expr,
    last_key: Expr,
):
    # score row s's online softmax over the block from key `first`: its probabilities in scores[s, :],
    # running[s, :] = (max, denominator, the rescale of what came before)
    # the block's keys this row sees are i in [seen_from, seen_to]; the run's rows from lo, their
    # ends (read with visible_ends only), the last key of the run
    seen_to: T.let[T.int32] = T.Cast(
        "int32",
        T.min(
            _row_last_key(plan, ends, lo + s // plan.group, first_position + s // plan.group, last_key)
            - first,
            T.int64(KEYS),
        ),
    )
    seen_from: T.let[T.int32] = T.Cast(
        "int32",
        T.max(
            first_position + s // plan.group - first - T.int64(plan.window) + 1,
            T.int64(-1),
        ),
    )
    for i in T.vectorized(KEYS):
        scores[s, i] = T.Select(
            T.And(i >= seen_from, i <= seen_to),
            scores[s, i],
            T.float32(-3.0e38),
        )
    _fold(tree, scores, s, True, running[s, 0])
    peak: T.let[T.float32] = tree[0]
    running[s, 2] = fast_exp(running[s, 0] - peak)
    running[s, 0] = peak
    for i in T.vectorized(KEYS):
        scores[s, i] = T.Select(
            T.And(i >= seen_from, i <= seen_to),
            fast_exp(scores[s, i] - peak),
            T.float32(0),
        )
    _fold(tree, scores, s, False, running[s, 1] * running[s, 2])
    running[s, 1] = tree[0]


@T.macro
def _add_values(
    plan: AttentionPlan, s: Expr, scores: Buffer, value: Buffer, acc: Buffer, running: Buffer, added: Buffer
):
    # acc[s, :] = acc[s, :] * rescale + sum_i p[s, i] * V[i, :], value_part floats at a time
    for h in T.serial(plan.head_dim // plan.value_part):
        for d in T.vectorized(plan.value_part):
            added[d] = acc[s, h * plan.value_part + d] * running[s, 2]
        for i in T.serial(KEYS):
            for d in T.vectorized(plan.value_part):
                added[d] = added[d] + scores[s, i] * value[i, h * plan.value_part + d]
        for d in T.vectorized(plan.value_part):
            acc[s, h * plan.value_part + d] = added[d]


# Epilogue: the segments' softmax states merged in order (or stored for the split form's second
# phase), the rows written.


@T.macro
def _start_merge(plan: AttentionPlan, total: Buffer, merged: Buffer, count: Expr):
    for s in T.serial(count * plan.group):
        total[s, 0] = T.float32(-3.0e38)
        total[s, 1] = T.float32(0)
        for d in T.vectorized(plan.head_dim):
            merged[s, d] = T.float32(0)


@T.macro
def _merge(
    plan: AttentionPlan, total: Buffer, merged: Buffer, s: Expr, peak: Expr, denominator: Expr, source: Buffer
):
    # score row s: (total[s, 0] max, total[s, 1] sum, merged[s, :]) merged with a segment's
    # (peak, denominator, source[s, :]); one macro for both phases, so the same arithmetic
    both: T.let[T.float32] = T.max(total[s, 0], peak)
    earlier: T.let[T.float32] = fast_exp(total[s, 0] - both)
    total[s, 2] = fast_exp(peak - both)
    total[s, 1] = total[s, 1] * earlier + denominator * total[s, 2]
    for d in T.vectorized(plan.head_dim):
        merged[s, d] = merged[s, d] * earlier + source[s, d] * total[s, 2]
    total[s, 0] = both


@T.macro
def _store_states(
    plan: AttentionPlan,
    count: Expr,
    state_block: Expr,
    state_rows: Expr,
    states: Buffer,
    running: Buffer,
    acc: Buffer,
):
    # the split form: a segment's softmax states, for the second phase to merge; they take the
    # `state_rows` rows of `states` from state_block * state_rows
    for s in T.serial(count * plan.group):
        row: T.let[T.int64] = state_block * state_rows + s
        states[row, 0] = running[s, 0]
        states[row, 1] = running[s, 1]
        for d in T.vectorized(plan.head_dim):
            states[row, 2 + d] = acc[s, d]


@T.macro
def _write_rows(
    plan: AttentionPlan, out: Buffer, lo: Expr, count: Expr, kvh: Expr, total: Buffer, merged: Buffer
):
    for r in T.serial(count):
        for g in T.serial(plan.group):
            for d in T.vectorized(plan.head_dim):
                out[lo + r, kvh * plan.group + g, d] = T.Cast(
                    plan.dtype, merged[r * plan.group + g, d] / total[r * plan.group + g, 1]
                )


@T.macro
def _zero_padding_rows(plan: AttentionPlan, out: Buffer, first: Expr, n: Expr):
    # the rows after the sequences' (the executable's padding): zeros, here, so that every task
    # is real work (TVM's parallel loop gives each thread a contiguous range of tasks)
    for r in T.serial(first, n):
        for h in T.serial(plan.heads):
            for d in T.vectorized(plan.head_dim):
                out[r, h, d] = T.Cast(plan.dtype, T.float32(0))


# The kernel: a task's run of rows, the split form's merge, the function.


@T.macro
def _attend_run(
    plan: AttentionPlan,
    seq: Expr,
    lo: Expr,
    hi: Expr,
    kvh: Expr,
    layer: Expr,
    scales: tuple,
    block_size: Expr,
    inputs: tuple,
    blocks: tuple,
    rows_state: tuple,
    split: tuple,
    ends: Buffer,
    tile_end: Expr | None,
):
    # rows [lo, hi) of sequence `seq` with kv head `kvh`: this task's share of their segments;
    # with visible_ends, the rows' `ends` and their furthest, `tile_end` (_furthest_end)
    q, cache, tables, lens, starts, out, states = inputs
    key_rows, key_t, value, block, tree, added = blocks  # one key block's
    query, acc, scores, running, total, merged = rows_state  # the run's score rows'
    share, parts, state_base, state_rows = split  # this task's part of `parts`; where it stores
    count: T.let[T.int64] = hi - lo
    first_position: T.let[T.int64] = lens[seq] - (starts[seq + 1] - starts[seq]) + (lo - starts[seq])
    last_key: T.let[T.int64] = _last_key(first_position, count, tile_end)
    lowest: T.let[T.int64] = T.max(T.int64(0), first_position - T.int64(plan.window) + T.int64(1))
    segment_first: T.let[T.int64] = lowest // SEGMENT
    per_part: T.let[T.int64] = (last_key // SEGMENT - segment_first + parts) // parts
    mine_first: T.let[T.int64] = segment_first + share * per_part
    mine_end: T.let[T.int64] = T.min(mine_first + per_part, last_key // SEGMENT + 1)
    _load_queries(plan, q, lo, count, kvh, query)
    _start_merge(plan, total, merged, count)
    for segment in T.serial(mine_first, T.max(mine_first, mine_end)):
        _start_segment(plan, count, acc, running)
        # blocks start at multiples of KEYS and segments at multiples of SEGMENT, whatever the
        # tile: the same sums for a row
        block_from: T.let[T.int64] = T.max(segment * SEGMENT, lowest // KEYS * KEYS)
        block_last: T.let[T.int64] = T.min(segment * SEGMENT + SEGMENT - 1, last_key)
        for c in T.serial(block_last // KEYS - block_from // KEYS + 1):
            first: T.let[T.int64] = block_from + c * KEYS
            _load_key_block(
                plan,
                cache,
                tables,
                seq,
                layer,
                kvh,
                block_size,
                first,
                last_key,
                scales,
                key_rows,
                value,
            )
            _transpose_keys(plan, key_rows, key_t)
            _block_scores(plan, count, query, key_t, block, scores)
            for s in T.serial(count * plan.group):
                _softmax_row(plan, s, first_position, first, scores, tree, running, ends, lo, last_key)
                _add_values(plan, s, scores, value, acc, running, added)
        if parts == 1:
            for s in T.serial(count * plan.group):
                _merge(plan, total, merged, s, running[s, 0], running[s, 1], acc)
        else:
            _store_states(plan, count, state_base + segment - segment_first, state_rows, states, running, acc)
    if parts == 1:
        _write_rows(plan, out, lo, count, kvh, total, merged)


@T.macro
def _merge_run(
    plan: AttentionPlan,
    seq: Expr,
    lo: Expr,
    hi: Expr,
    kvh: Expr,
    inputs: tuple,
    rows_state: tuple,
    state_base: Expr,
    state_rows: Expr,
    tile_end: Expr | None,
):
    # the split form's second phase: the segments' states in order, as _attend_run merges them
    lens, starts, out, states = inputs
    acc, running, total, merged = rows_state
    count: T.let[T.int64] = hi - lo
    first_position: T.let[T.int64] = lens[seq] - (starts[seq + 1] - starts[seq]) + (lo - starts[seq])
    last_key: T.let[T.int64] = _last_key(first_position, count, tile_end)
    lowest: T.let[T.int64] = T.max(T.int64(0), first_position - T.int64(plan.window) + T.int64(1))
    _start_merge(plan, total, merged, count)
    for segment in T.serial(last_key // SEGMENT - lowest // SEGMENT + 1):
        for s in T.serial(count * plan.group):
            row: T.let[T.int64] = (state_base + segment) * state_rows + s
            running[s, 0] = states[row, 0]
            running[s, 1] = states[row, 1]
            for d in T.vectorized(plan.head_dim):
                acc[s, d] = states[row, 2 + d]
            _merge(plan, total, merged, s, running[s, 0], running[s, 1], acc)
    _write_rows(plan, out, lo, count, kvh, total, merged)


def _attention_kernel(plan: AttentionPlan) -> tirx.PrimFunc:
    """The function over (q, cache, tables, lens, starts, ends, layer, k_scale, v_scale, out), without
    `ends` where the plan has no visible_ends."""

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
        q = T.match_buffer(q_handle, (n, plan.heads, plan.head_dim), plan.dtype)
        cache = T.match_buffer(
            cache_handle,
            (num_layers, 2, num_blocks, block_size, plan.kv_heads, plan.head_dim),
            plan.cache_dtype,
        )
        tables = T.match_buffer(tables_handle, (num_seqs, max_blocks), "int64")
        lens = T.match_buffer(lens_handle, (num_seqs,), "int64")
        starts = T.match_buffer(starts_handle, (num_starts,), "int64")
        ends = T.match_buffer(ends_handle, (n,), "int64")  # read only with plan.visible_ends
        out = T.match_buffer(out_handle, (n, plan.heads, plan.head_dim), plan.dtype)
        span: T.let[T.int64] = _span(plan, n)
        _zero_padding_rows(plan, out, starts[num_seqs], n)
        sizes = T.alloc_buffer((2,), "int64")
        _tile_and_segment_counts(plan, sizes, starts, lens, num_seqs, span)
        tiles: T.let[T.int64] = sizes[0]
        # a split step's states go to `states`, merged in order by a second loop
        parts: T.let[T.int64] = _parts(plan, n, span, tiles, sizes[1])
        state_rows: T.let[T.int64] = span * plan.group
        segments: T.let[T.int64] = (max_blocks * block_size + SEGMENT - 1) // SEGMENT
        states = T.alloc_buffer(
            (_states_capacity(plan, n, max_blocks, block_size), plan.head_dim + 2), "float32"
        )
        for task in T.parallel(tiles * plan.kv_heads * parts):
            with T.sblock("attend"):
                T.reads()
                T.writes()
                query = T.sblock_alloc_buffer((plan.padded, plan.head_dim), "float32")
                acc = T.sblock_alloc_buffer((plan.padded, plan.head_dim), "float32")
                merged = T.sblock_alloc_buffer((plan.padded, plan.head_dim), "float32")
                key_rows = T.sblock_alloc_buffer((KEYS, plan.head_dim), "float32")
                key_t = T.sblock_alloc_buffer((plan.head_dim, KEYS), "float32")
                value = T.sblock_alloc_buffer((KEYS, plan.head_dim), "float32")
                scores = T.sblock_alloc_buffer((plan.padded, KEYS), "float32")
                block = T.sblock_alloc_buffer((SCORE_ROWS, KEYS), "float32")
                tree = T.sblock_alloc_buffer((KEYS,), "float32")
                added = T.sblock_alloc_buffer((plan.value_part,), "float32")
                # a segment's max, denominator, the rescale of what came before; the merged ones
                running = T.sblock_alloc_buffer((plan.padded, 3), "float32")
                total = T.sblock_alloc_buffer((plan.padded, 3), "float32")
                found = T.sblock_alloc_buffer((plan.found_size,), "int64")
                share: T.let[T.int64] = task % parts
                slot: T.let[T.int64] = task // parts // plan.kv_heads
                kvh: T.let[T.int64] = task // parts % plan.kv_heads
                # early and late tiles alternate, so that contiguous ranges of tasks carry similar work
                tile: T.let[T.int64] = T.if_then_else(slot % 2 == 0, slot // 2, tiles - 1 - slot // 2)
                _locate(tile, span, starts, num_seqs, found)
                if plan.visible_ends:
                    _furthest_end(ends, lens, found)
                inputs = (q, cache, tables, lens, starts, out, states)
                blocks = (key_rows, key_t, value, block, tree, added)
                rows_state = (query, acc, scores, running, total, merged)
                split = (share, parts, (tile * plan.kv_heads + kvh) * segments, state_rows)
                _attend_run(
                    plan,
                    found[1],
                    found[2],
                    found[3],
                    kvh,
                    layer,
                    (k_scale, v_scale),
                    block_size,
                    inputs,
                    blocks,
                    rows_state,
                    split,
                    ends,
                    _tile_end(plan, found),
                )
        if parts > 1:
            for task in T.parallel(tiles * plan.kv_heads):
                with T.sblock("merge"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((plan.padded, plan.head_dim), "float32")
                    merged = T.sblock_alloc_buffer((plan.padded, plan.head_dim), "float32")
                    running = T.sblock_alloc_buffer((plan.padded, 3), "float32")
                    total = T.sblock_alloc_buffer((plan.padded, 3), "float32")
                    found = T.sblock_alloc_buffer((plan.found_size,), "int64")
                    tile: T.let[T.int64] = task // plan.kv_heads
                    kvh: T.let[T.int64] = task % plan.kv_heads
                    _locate(tile, span, starts, num_seqs, found)
                    if plan.visible_ends:
                        _furthest_end(ends, lens, found)
                    _merge_run(
                        plan,
                        found[1],
                        found[2],
                        found[3],
                        kvh,
                        (lens, starts, out, states),
                        (acc, running, total, merged),
                        (tile * plan.kv_heads + kvh) * segments,
                        state_rows,
                        _tile_end(plan, found),
                    )

    return attention if plan.visible_ends else without_param(attention, "ends")


def without_param(func: tirx.PrimFunc, name: str) -> tirx.PrimFunc:
    """`func` without its parameter `name`, which its body never reads."""
    kept = [param for param in func.params if param.name != name]
    assert len(kept) == len(func.params) - 1
    return tirx.PrimFunc(kept, func.body, func.ret_type, func.attrs)


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
    """`cache_dtype` as in kv_write_kernel. `visible_ends`: the kernel takes `ends` [n] after `starts`;
    row r sees keys up to ends[r] - 1 (from the window's start) instead of up to its own position."""
    plan = AttentionPlan(
        heads, kv_heads, head_dim, scale, sliding_window, dtype, cache_dtype or dtype, visible_ends
    )
    return _attention_kernel(plan)
