"""An image encoder's dense attention on the CPU as three kernels: the heads' score matrices and the
weighted sums of values are batched matrix products scheduled as the float linears are (linear.py:
column strips in vectors across cores, 4 rows x strip accumulated in registers), and between them a
row-wise softmax (keys at or past `num_rows` left out, float32, exponentials in vectors).

    scores[h, i, j] = sum_d q[h, i, d] * keys[h, d, j]       (keys: k transposed to [H, D, T])
    probs = softmax(scores * scale) over j < num_rows
    out[h, i, e] = sum_j probs[h, i, j] * v[h, j, e]

Rows are padded to a multiple of 4 (ROW_BLOCK); a padding query row's result is set to zero by the
caller, as the reference does.
"""

from __future__ import annotations

from tvm import s_tir, te, tirx

from kiln.backends.tvm.kernels.fast_exp import fast_exp
from kiln.backends.tvm.kernels.linear import ROW_BLOCK, column_tile


def batched_matmul_kernel(rows: int | None, k: int | None, n: int | None, heads: int) -> tirx.PrimFunc:
    """(x[H, T, K], w[H, K, N]) -> y[H, T, N]; a None size is the symbolic row count T."""
    t = tirx.Var("t", "int64")

    def size(value: int | None) -> int | tirx.Var:
        return t if value is None else value

    x = te.placeholder((heads, size(rows), size(k)), "float32", name="x")
    w = te.placeholder((heads, size(k), size(n)), "float32", name="w")
    reduce = te.reduce_axis((0, size(k)), name="k")
    product = te.compute(
        (heads, size(rows), size(n)),
        lambda h, i, j: te.sum(x[h, i, reduce] * w[h, reduce, j], axis=reduce),
        name="product",
    )
    return te.create_prim_func([x, w, product])


def schedule_batched_matmul_cpu(func: tirx.PrimFunc, n: int | None) -> tirx.PrimFunc:
    """Heads x column strips across cores; each strip's 4 rows accumulated in registers."""
    sch = s_tir.Schedule(func)
    block = sch.get_sblock("product")
    h, i, j, k = sch.get_loops(block)
    if n is None:  # columns over the symbolic row count: rows across cores, the columns left to LLVM
        sch.reorder(h, i, k, j)
        sch.parallel(sch.fuse(h, i))
        sch.decompose_reduction(block, k)
        return sch.mod["main"].with_attr("tirx.is_scheduled", True)
    tile = column_tile(n)
    a, b = sch.split(i, [None, ROW_BLOCK])
    jo, ji = sch.split(j, [None, tile])
    sch.reorder(h, jo, a, k, b, ji)
    sch.parallel(sch.fuse(h, jo))
    sch.vectorize(ji)
    sch.unroll(b)
    write_back = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(write_back, a)
    sch.decompose_reduction(block, k)
    sch.vectorize(sch.get_loops(write_back)[-1])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def masked_softmax_kernel(rows: int | None, heads: int, scale: float) -> tirx.PrimFunc:
    """(scores[H, T, T], num_rows[1] int64) -> probs: softmax of scores * scale over keys < num_rows."""
    t = tirx.Var("t", "int64") if rows is None else rows
    scores = te.placeholder((heads, t, t), "float32", name="scores")
    num_rows = te.placeholder((1,), "int64", name="num_rows")
    scale_const = tirx.const(scale, "float32")
    lowest = tirx.const(float("-inf"), "float32")
    j = te.reduce_axis((0, t), name="j")
    top = te.compute(
        (heads, t),
        lambda h, i: te.max(
            tirx.if_then_else(j < num_rows[0], scores[h, i, j] * scale_const, lowest), axis=j
        ),
        name="top",
    )
    weights = te.compute(
        (heads, t, t),
        lambda h, i, jj: tirx.if_then_else(
            jj < num_rows[0], fast_exp(scores[h, i, jj] * scale_const - top[h, i]), tirx.const(0.0, "float32")
        ),
        name="weights",
    )
    j2 = te.reduce_axis((0, t), name="j2")
    total = te.compute((heads, t), lambda h, i: te.sum(weights[h, i, j2], axis=j2), name="total")
    probs = te.compute((heads, t, t), lambda h, i, jj: weights[h, i, jj] / total[h, i], name="probs")
    return te.create_prim_func([scores, num_rows, probs])


def schedule_masked_softmax_cpu(func: tirx.PrimFunc, rows: int | None) -> tirx.PrimFunc:
    """A row (head, query) at a time across cores, its exponentials and division in vectors."""
    sch = s_tir.Schedule(func)
    probs = sch.get_sblock("probs")
    h, i, _ = sch.get_loops(probs)
    row = sch.fuse(h, i)
    sch.parallel(row)
    for name in ("total", "weights", "top"):
        sch.compute_at(sch.get_sblock(name), row)
    tile = column_tile(rows) if rows is not None else ROW_BLOCK
    for name in ("weights", "probs"):
        _, inner = sch.split(sch.get_loops(sch.get_sblock(name))[-1], [None, tile])
        sch.vectorize(inner)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)
