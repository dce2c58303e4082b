"""The lora op (ir/ops/lora.py) as TIR: y[r, piece g's columns] += (x[r] @ a_g[layer, s].T) @ b_g[layer, s].T
for each row r whose adapter slot s = slots[r] is one of the tables' (0 <= s < LS), in place on y.

One design, two targets: a row and a piece are one unit of work, computed on their own in two
stages through the row's low-rank vector t [LR] (float32, rounded to the activations' dtype as the
reference rounds it):

    down  t[j] = sum_k x[r, k] * a_g[layer, s, j, k]                 (every rank j < LR)
    up    y[r, start_g + c] += sum_j b_g[layer, s, j, c] * t[j]      (every column c of the piece)

`down` is a dot product along a's contiguous dim (k), `up` a sum of b's rows (contiguous in the
columns) scaled by t, the ranks in order; each in a fixed order that depends on the shapes only, so a
row's result depends on its own x, slot and the tables, never on the other rows of the step (batch
invariance); a row without an adapter (slot -1: the base model, and the executable's padding rows)
reads no table and keeps its bits. Rows past the
real ones (`counts[which]`: the step's row_counts, token rows for a step over T, logits rows over L)
are skipped too.

CPU: a serial scan of the slots first; when no row has an adapter (LoRA compiled in, unused: the
0.3 µs a call measured) the kernel returns there, without starting the parallel loop. Otherwise one
parallel task per (row, piece), its t [LR] in the task's workspace. `down`: BLOCK ranks side by side
share the loads of x, each summing k in vector lanes (a fixed tree of the lanes at the end); `up`:
BLOCK vectors of LANES columns side by side, each rank's row of b times the broadcast t[j] added in
(then single vectors, then single columns for the piece's last ones). Tables are read unaligned
(the runtime's numpy arrays are 16-byte aligned).

CUDA: one thread block per (row, piece), THREADS threads, three phases split by barriers: `down`,
the block's warps take the ranks in turn, a warp's lanes the k = lane (mod 32) of a rank (32
adjacent values of a read together) into shared partial sums; the ranks' sums of their 32 partials
in order, into t in shared memory (MAX_RANK ranks at most: the executable refuses larger tables on a
GPU); `up`, the threads take the piece's columns (adjacent threads, adjacent columns of b's rows),
each summing its column over the ranks in order.

The kernel takes (y, x, slots, a_0, b_0, ..., a_{P-1}, b_{P-1}, counts, which, layer), y in place.
"""

from __future__ import annotations

from typing import Any

from tvm import tirx
from tvm.script import tirx as T
from tvm.tirx import Buffer

from kiln.backends.tvm.kernels.attention import without_param
from kiln.ir.ops.lora import MAX_LORA_PIECES

Expr = Any  # a TIR expression
THREADS = 128  # a CUDA thread block's threads
WARP = 32  # the CUDA kernel's lanes over k
WARPS = THREADS // WARP
MAX_RANK = 256  # the largest rank (LR) the CUDA kernel computes: its shared t [MAX_RANK]
LANES = 16  # the CPU kernel's widest vector (float32)
BLOCK = 4  # the CPU kernel's ranks (down) and columns (up) side by side, for the independent sums


def lanes(n: int) -> int:
    """The widest vector (LANES at most) that divides `n`."""
    for width in (LANES, 8, 4, 2):
        if n % width == 0:
            return width
    return 1


def _rounded(value: Expr, dtype: str) -> Expr:
    """A float32 value rounded to `dtype` and back (the reference's low-rank vector is in x's dtype)."""
    return value if dtype == "float32" else T.Cast("float32", T.Cast(dtype, value))


@T.macro
def _sum_lanes(acc: Buffer, q: Expr, width: int):
    # acc[q, 0] = the sum of acc[q, :width], in a fixed tree
    if width >= 16:
        for i in T.vectorized(8):
            acc[q, i] = acc[q, i] + acc[q, i + 8]
    if width >= 8:
        for i in T.vectorized(4):
            acc[q, i] = acc[q, i] + acc[q, i + 4]
    if width >= 4:
        for i in T.vectorized(2):
            acc[q, i] = acc[q, i] + acc[q, i + 2]
    if width >= 2:
        acc[q, 0] = acc[q, 0] + acc[q, 1]


@T.macro
def _cpu_down(
    x: Buffer,
    a: Buffer,
    t: Buffer,
    acc: Buffer,
    row: Expr,
    slot: Expr,
    layer: Expr,
    first: Expr,
    count: int,
    k: int,
    dtype: str,
):
    # t[first .. first + count - 1]: each rank's sum over k in lanes, then a fixed tree of the lanes;
    # `count` ranks side by side share the loads of x
    for q in T.unroll(count):
        for i in T.vectorized(lanes(k)):
            acc[q, i] = T.float32(0)
    for ko in T.serial(k // lanes(k)):
        for q in T.unroll(count):
            for i in T.vectorized(lanes(k)):
                acc[q, i] = acc[q, i] + T.Cast("float32", x[row, ko * lanes(k) + i]) * T.Cast(
                    "float32", a[layer, slot, first + q, ko * lanes(k) + i]
                )
    for q in T.unroll(count):
        _sum_lanes(acc, q, lanes(k))
        t[first + q] = _rounded(acc[q, 0], dtype)


@T.macro
def _cpu_up(
    y: Buffer,
    b: Buffer,
    t: Buffer,
    acc: Buffer,
    row: Expr,
    slot: Expr,
    layer: Expr,
    rank: Expr,
    first: int,
    count: int,
    width: int,
    start: int,
    dtype: str,
):
    # y[row, start + first + c] += sum_j b[j, first + c] * t[j] for `count` vectors of `width` columns:
    # b's rows are contiguous in the columns, so each rank adds one broadcast t[j] times whole vectors
    # (the ranks in order; no sum across lanes)
    for q in T.unroll(count):
        for i in T.vectorized(width):
            acc[q, i] = T.float32(0)
    for j in T.serial(rank):
        for q in T.unroll(count):
            for i in T.vectorized(width):
                acc[q, i] = acc[q, i] + T.Cast("float32", b[layer, slot, j, first + q * width + i]) * t[j]
    for q in T.unroll(count):
        for i in T.vectorized(width):
            column: T.let[T.int64] = T.int64(start + first + q * width) + i
            y[row, column] = y[row, column] + T.Cast(dtype, acc[q, i])


@T.macro
def _cpu_columns(
    y: Buffer,
    b: Buffer,
    t: Buffer,
    acc: Buffer,
    row: Expr,
    slot: Expr,
    layer: Expr,
    rank: Expr,
    start: int,
    size: int,
    dtype: str,
):
    # BLOCK vectors of LANES columns at a time, then single vectors, then single columns
    wide = BLOCK * LANES
    for cb in T.serial(size // wide):
        _cpu_up(y, b, t, acc, row, slot, layer, rank, cb * wide, BLOCK, LANES, start, dtype)
    for v in T.serial(size % wide // LANES):
        _cpu_up(y, b, t, acc, row, slot, layer, rank, size // wide * wide + v * LANES, 1, LANES, start, dtype)
    for c in T.serial(size % LANES):
        _cpu_up(y, b, t, acc, row, slot, layer, rank, size // LANES * LANES + c, 1, 1, start, dtype)


@T.macro
def _cpu_piece(
    y: Buffer,
    x: Buffer,
    a: Buffer,
    b: Buffer,
    t: Buffer,
    acc: Buffer,
    row: Expr,
    slot: Expr,
    layer: Expr,
    rank: Expr,
    k: int,
    start: int,
    size: int,
    dtype: str,
):
    for jb in T.serial(rank // BLOCK):
        _cpu_down(x, a, t, acc, row, slot, layer, jb * BLOCK, BLOCK, k, dtype)
    for j in T.serial(rank % BLOCK):
        _cpu_down(x, a, t, acc, row, slot, layer, rank // BLOCK * BLOCK + j, 1, k, dtype)
    _cpu_columns(y, b, t, acc, row, slot, layer, rank, start, size, dtype)


@T.macro
def _gpu_down(
    x: Buffer,
    a: Buffer,
    partial: Buffer,
    acc: Buffer,
    row: Expr,
    slot: Expr,
    layer: Expr,
    rank: Expr,
    tx: Expr,
    k: int,
):
    # partial[j, lane] = rank j's sum over the k = lane (mod WARP): a warp's 32 lanes read 32 adjacent
    # values of a[.., j, :]; the block's warps take the ranks in turn
    lane: T.let[T.int64] = T.Cast("int64", tx) % WARP
    warp: T.let[T.int64] = T.Cast("int64", tx) // WARP
    for step in T.serial((rank + WARPS - 1) // WARPS):
        j: T.let[T.int64] = step * WARPS + warp
        if j < rank:
            acc[0] = T.float32(0)
            for kk in T.serial((k + WARP - 1) // WARP):
                if kk * WARP + lane < k:
                    acc[0] = acc[0] + T.Cast("float32", x[row, kk * WARP + lane]) * T.Cast(
                        "float32", a[layer, slot, j, kk * WARP + lane]
                    )
            partial[j, lane] = acc[0]


@T.macro
def _gpu_ranks(partial: Buffer, t: Buffer, acc: Buffer, rank: Expr, tx: Expr, dtype: str):
    # t[j] = the sum of rank j's WARP partial sums, in order
    for step in T.serial(MAX_RANK // THREADS):
        j: T.let[T.int64] = T.int64(step * THREADS) + T.Cast("int64", tx)
        if j < rank:
            acc[0] = T.float32(0)
            for lane in T.serial(WARP):
                acc[0] = acc[0] + partial[j, lane]
            t[j] = _rounded(acc[0], dtype)


@T.macro
def _gpu_up(
    y: Buffer,
    b: Buffer,
    t: Buffer,
    acc: Buffer,
    row: Expr,
    slot: Expr,
    layer: Expr,
    rank: Expr,
    tx: Expr,
    start: int,
    size: int,
    dtype: str,
):
    for step in T.serial((size + THREADS - 1) // THREADS):
        c: T.let[T.int64] = T.int64(step * THREADS) + T.Cast("int64", tx)
        if c < T.int64(size):
            acc[0] = T.float32(0)
            for j in T.serial(rank):
                acc[0] = acc[0] + T.Cast("float32", b[layer, slot, j, c]) * t[j]
            y[row, start + c] = y[row, start + c] + T.Cast(dtype, acc[0])


def lora_kernel(
    k: int, sizes: list[int], dtype: str, target_kind: str, table_dtype: str | None = None
) -> tirx.PrimFunc:
    """The kernel of a lora op whose x has `k` columns and whose y's columns are `sizes` pieces, for
    "cpu" or "cuda"; `dtype` is TVM's name of the activations' dtype, `table_dtype` the tables' (None:
    the same; float16 tables halve what an adapter's rows read, each element widened to float32)."""
    table_dtype = table_dtype or dtype
    pieces = len(sizes)
    if not 1 <= pieces <= MAX_LORA_PIECES:
        raise ValueError(f"lora: {pieces} pieces (1 .. {MAX_LORA_PIECES})")
    make = _cuda_kernel if target_kind == "cuda" else _cpu_kernel
    func = make(k, sizes, dtype, table_dtype)
    for i in range(pieces, MAX_LORA_PIECES):  # the absent pieces' tables
        func = without_param(without_param(func, f"a{i}_handle"), f"b{i}_handle")
    return func


def _pieces(sizes: list[int]) -> tuple[list[int], list[int]]:
    """(each piece's columns, its first column), the absent pieces' 1 (their tables are never matched)."""
    padded = [*sizes, *[1] * (MAX_LORA_PIECES - len(sizes))]
    return padded, [sum(padded[:i]) for i in range(MAX_LORA_PIECES)]


def _cpu_kernel(k: int, sizes: list[int], dtype: str, table_dtype: str) -> tirx.PrimFunc:
    pieces, total = len(sizes), sum(sizes)
    (s0, s1, s2, s3), (c0, c1, c2, c3) = _pieces(sizes)

    @T.prim_func(s_tir=True)
    def lora(
        y_handle: T.handle,
        x_handle: T.handle,
        slots_handle: T.handle,
        a0_handle: T.handle,
        b0_handle: T.handle,
        a1_handle: T.handle,
        b1_handle: T.handle,
        a2_handle: T.handle,
        b2_handle: T.handle,
        a3_handle: T.handle,
        b3_handle: T.handle,
        counts_handle: T.handle,
        which: T.int64,
        layer: T.int64,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int64()
        layers = T.int64()
        num_slots = T.int64()
        rank = T.int64()
        y = T.match_buffer(y_handle, (n, total), dtype)
        x = T.match_buffer(x_handle, (n, k), dtype)
        slots = T.match_buffer(slots_handle, (n,), "int64")
        # tables are the runtime's arrays: no alignment assumed (numpy's allocator aligns to 16 bytes)
        a0 = T.match_buffer(a0_handle, (layers, num_slots, rank, k), table_dtype, align=4)
        b0 = T.match_buffer(b0_handle, (layers, num_slots, rank, s0), table_dtype, align=4)
        if pieces >= 2:
            a1 = T.match_buffer(a1_handle, (layers, num_slots, rank, k), table_dtype, align=4)
            b1 = T.match_buffer(b1_handle, (layers, num_slots, rank, s1), table_dtype, align=4)
        if pieces >= 3:
            a2 = T.match_buffer(a2_handle, (layers, num_slots, rank, k), table_dtype, align=4)
            b2 = T.match_buffer(b2_handle, (layers, num_slots, rank, s2), table_dtype, align=4)
        if pieces >= 4:
            a3 = T.match_buffer(a3_handle, (layers, num_slots, rank, k), table_dtype, align=4)
            b3 = T.match_buffer(b3_handle, (layers, num_slots, rank, s3), table_dtype, align=4)
        counts = T.match_buffer(counts_handle, (2,), "int64")
        rows: T.let[T.int64] = T.min(counts[which], n)
        found = T.alloc_buffer((1,), "int64")
        found[0] = T.int64(0)
        for r in T.serial(rows):
            if T.And(slots[r] >= T.int64(0), slots[r] < num_slots):
                found[0] = T.int64(1)
        if found[0] > T.int64(0):
            for task in T.parallel(rows * pieces):
                with T.sblock("lora"):
                    T.reads()
                    T.writes()
                    t = T.sblock_alloc_buffer((rank,), "float32")
                    acc = T.sblock_alloc_buffer((BLOCK, LANES), "float32")
                    row: T.let[T.int64] = task // pieces
                    piece: T.let[T.int64] = task % pieces
                    slot: T.let[T.int64] = slots[row]
                    if T.And(slot >= T.int64(0), slot < num_slots):
                        if piece == 0:
                            _cpu_piece(y, x, a0, b0, t, acc, row, slot, layer, rank, k, c0, s0, dtype)
                        if pieces >= 2:
                            if piece == 1:
                                _cpu_piece(y, x, a1, b1, t, acc, row, slot, layer, rank, k, c1, s1, dtype)
                        if pieces >= 3:
                            if piece == 2:
                                _cpu_piece(y, x, a2, b2, t, acc, row, slot, layer, rank, k, c2, s2, dtype)
                        if pieces >= 4:
                            if piece == 3:
                                _cpu_piece(y, x, a3, b3, t, acc, row, slot, layer, rank, k, c3, s3, dtype)

    return lora


def _cuda_kernel(k: int, sizes: list[int], dtype: str, table_dtype: str) -> tirx.PrimFunc:
    pieces, total = len(sizes), sum(sizes)
    (s0, s1, s2, s3), (c0, c1, c2, c3) = _pieces(sizes)

    @T.prim_func(s_tir=True)
    def lora(
        y_handle: T.handle,
        x_handle: T.handle,
        slots_handle: T.handle,
        a0_handle: T.handle,
        b0_handle: T.handle,
        a1_handle: T.handle,
        b1_handle: T.handle,
        a2_handle: T.handle,
        b2_handle: T.handle,
        a3_handle: T.handle,
        b3_handle: T.handle,
        counts_handle: T.handle,
        which: T.int64,
        layer: T.int64,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int64()
        layers = T.int64()
        num_slots = T.int64()
        rank = T.int64()
        y = T.match_buffer(y_handle, (n, total), dtype)
        x = T.match_buffer(x_handle, (n, k), dtype)
        slots = T.match_buffer(slots_handle, (n,), "int64")
        a0 = T.match_buffer(a0_handle, (layers, num_slots, rank, k), table_dtype, align=4)
        b0 = T.match_buffer(b0_handle, (layers, num_slots, rank, s0), table_dtype, align=4)
        if pieces >= 2:
            a1 = T.match_buffer(a1_handle, (layers, num_slots, rank, k), table_dtype, align=4)
            b1 = T.match_buffer(b1_handle, (layers, num_slots, rank, s1), table_dtype, align=4)
        if pieces >= 3:
            a2 = T.match_buffer(a2_handle, (layers, num_slots, rank, k), table_dtype, align=4)
            b2 = T.match_buffer(b2_handle, (layers, num_slots, rank, s2), table_dtype, align=4)
        if pieces >= 4:
            a3 = T.match_buffer(a3_handle, (layers, num_slots, rank, k), table_dtype, align=4)
            b3 = T.match_buffer(b3_handle, (layers, num_slots, rank, s3), table_dtype, align=4)
        counts = T.match_buffer(counts_handle, (2,), "int64")
        for task in T.thread_binding(n * pieces, thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("lora"):
                    T.reads()
                    T.writes()
                    t = T.sblock_alloc_buffer((MAX_RANK,), "float32", scope="shared")
                    partial = T.sblock_alloc_buffer((MAX_RANK, WARP), "float32", scope="shared")
                    acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    chosen = T.sblock_alloc_buffer((1,), "int64", scope="local")  # the row's slot, or -1
                    row: T.let[T.int64] = task // pieces
                    piece: T.let[T.int64] = task % pieces
                    chosen[0] = T.int64(-1)
                    if row < counts[which]:
                        if T.And(T.And(slots[row] >= T.int64(0), slots[row] < num_slots), rank <= MAX_RANK):
                            chosen[0] = slots[row]
                    if chosen[0] >= T.int64(0):
                        if piece == 0:
                            _gpu_down(x, a0, partial, acc, row, chosen[0], layer, rank, tx, k)
                        if pieces >= 2:
                            if piece == 1:
                                _gpu_down(x, a1, partial, acc, row, chosen[0], layer, rank, tx, k)
                        if pieces >= 3:
                            if piece == 2:
                                _gpu_down(x, a2, partial, acc, row, chosen[0], layer, rank, tx, k)
                        if pieces >= 4:
                            if piece == 3:
                                _gpu_down(x, a3, partial, acc, row, chosen[0], layer, rank, tx, k)
                    T.tvm_storage_sync("shared")
                    if chosen[0] >= T.int64(0):
                        _gpu_ranks(partial, t, acc, rank, tx, dtype)
                    T.tvm_storage_sync("shared")
                    if chosen[0] >= T.int64(0):
                        if piece == 0:
                            _gpu_up(y, b0, t, acc, row, chosen[0], layer, rank, tx, c0, s0, dtype)
                        if pieces >= 2:
                            if piece == 1:
                                _gpu_up(y, b1, t, acc, row, chosen[0], layer, rank, tx, c1, s1, dtype)
                        if pieces >= 3:
                            if piece == 2:
                                _gpu_up(y, b2, t, acc, row, chosen[0], layer, rank, tx, c2, s2, dtype)
                        if pieces >= 4:
                            if piece == 3:
                                _gpu_up(y, b3, t, acc, row, chosen[0], layer, rank, tx, c3, s3, dtype)

    return lora
