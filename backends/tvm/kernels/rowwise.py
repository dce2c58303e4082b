"""Row-wise kernels as TE: RMSNorm (optionally after a residual add), rotary embedding and SwiGLU.

Each is computed the way the reference computes it (float32 inside), and on the CPU scheduled with
rows in parallel and the hidden dim vectorized.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tvm import s_tir, te, tirx, topi

from kiln.backends.tvm.kernels.linear import DTYPE_NAMES, column_tile


def rms_norm_kernel(hidden: int, eps: float, dtype: str, with_residual: bool) -> tirx.PrimFunc:
    """(x[n, H], [residual[n, H]], weight[H]) -> normed[n, H] (, summed[n, H])."""
    float_dtype = DTYPE_NAMES[dtype]
    rows = tirx.Var("n", "int64")
    x = te.placeholder((rows, hidden), float_dtype, name="x")
    inputs = [x]
    if with_residual:
        residual = te.placeholder((rows, hidden), float_dtype, name="residual")
        inputs.append(residual)
        total = te.compute((rows, hidden), lambda i, j: x[i, j] + residual[i, j], name="total")
    else:
        total = x
    weight = te.placeholder((hidden,), float_dtype, name="weight")
    k = te.reduce_axis((0, hidden), name="k")
    square_sum = te.compute(
        (rows,),
        lambda i: te.sum(total[i, k].astype("float32") * total[i, k].astype("float32"), axis=k),
        name="square_sum",
    )
    normed = te.compute(
        (rows, hidden),
        lambda i, j: (
            weight[j]
            * (
                total[i, j].astype("float32")
                * tirx.rsqrt(square_sum[i] / tirx.const(hidden, "float32") + tirx.const(eps, "float32"))
            ).astype(float_dtype)
        ),
        name="normed",
    )
    outputs = [normed, total] if with_residual else [normed]
    return te.create_prim_func([*inputs, weight, *outputs])


def _rows_parallel_columns_vectorized(sch: s_tir.Schedule, block_name: str, columns: int) -> Any:
    """Rows across cores, the columns in vectors; returns the row loop."""
    rows, column = sch.get_loops(sch.get_sblock(block_name))
    sch.parallel(rows)
    tile = column_tile(columns)
    if tile > 1:
        _, inner = sch.split(column, [None, tile])
        sch.vectorize(inner)
    return rows


def schedule_rms_norm_cpu(func: tirx.PrimFunc, hidden: int, with_residual: bool) -> tirx.PrimFunc:
    sch = s_tir.Schedule(func)
    rows = _rows_parallel_columns_vectorized(sch, "normed", hidden)
    sch.compute_at(sch.get_sblock("square_sum"), rows)
    if with_residual:  # an output too, so a loop nest of its own
        _rows_parallel_columns_vectorized(sch, "total", hidden)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def rope_tables(head_dim: int, inv_freq: np.ndarray) -> np.ndarray:
    """inv_freq repeated for both halves: the per-dim frequency [head_dim] float32."""
    return np.concatenate([inv_freq, inv_freq]).astype(np.float32).reshape(head_dim)


def rope_kernel(heads: int, head_dim: int, dtype: str, scale: float = 1.0) -> tirx.PrimFunc:
    """(x[n, heads, head_dim], positions[n], frequency[head_dim]) -> rotated x, "rotate half" layout;
    cos and sin times `scale` (longrope's attention factor)."""
    float_dtype = DTYPE_NAMES[dtype]
    rows = tirx.Var("n", "int64")
    x = te.placeholder((rows, heads, head_dim), float_dtype, name="x")
    positions = te.placeholder((rows,), "int64", name="positions")
    table = te.placeholder((head_dim,), "float32", name="frequency")
    half = head_dim // 2
    angle = te.compute((rows, head_dim), lambda i, d: positions[i].astype("float32") * table[d], name="angle")
    factor = tirx.const(scale, "float32")
    cos = te.compute(  # once a row, not a head
        (rows, head_dim),
        lambda i, d: tirx.cos(angle[i, d]) * factor if scale != 1.0 else tirx.cos(angle[i, d]),
        name="cos",
    )
    sin = te.compute(
        (rows, head_dim),
        lambda i, d: tirx.sin(angle[i, d]) * factor if scale != 1.0 else tirx.sin(angle[i, d]),
        name="sin",
    )
    out = te.compute(
        (rows, heads, head_dim),
        lambda i, h, d: (
            x[i, h, d] * cos[i, d].astype(float_dtype)
            + tirx.if_then_else(d < half, -x[i, h, d + half], x[i, h, d - half])
            * sin[i, d].astype(float_dtype)
        ),
        name="rotated",
    )
    return te.create_prim_func([x, positions, table, out])


def schedule_rope_cpu(func: tirx.PrimFunc) -> tirx.PrimFunc:
    sch = s_tir.Schedule(func)
    rotated = sch.get_sblock("rotated")
    i = sch.get_loops(rotated)[0]
    sch.parallel(i)
    for table in ("sin", "cos"):
        sch.compute_at(sch.get_sblock(table), i)
    sch.compute_inline(sch.get_sblock("angle"))
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def swiglu_kernel(intermediate: int, dtype: str, fused: bool) -> tirx.PrimFunc:
    """silu(gate) * up: (gate_up[n, 2I]) or (gate[n, I], up[n, I]) -> [n, I]. The exponential is TVM's
    fast_exp (a vectorizable polynomial, within a few float32 ulps), not a libm call per value."""
    float_dtype = DTYPE_NAMES[dtype]
    rows = tirx.Var("n", "int64")
    if fused:
        gate_up = te.placeholder((rows, 2 * intermediate), float_dtype, name="gate_up")
        inputs = [gate_up]
        gate = te.compute((rows, intermediate), lambda i, j: gate_up[i, j].astype("float32"), name="gate")
        up = te.compute(
            (rows, intermediate), lambda i, j: gate_up[i, j + intermediate].astype("float32"), name="up"
        )
    else:
        gate_in = te.placeholder((rows, intermediate), float_dtype, name="gate_in")
        up_in = te.placeholder((rows, intermediate), float_dtype, name="up_in")
        inputs = [gate_in, up_in]
        gate = te.compute((rows, intermediate), lambda i, j: gate_in[i, j].astype("float32"), name="gate")
        up = te.compute((rows, intermediate), lambda i, j: up_in[i, j].astype("float32"), name="up")
    negated = te.compute((rows, intermediate), lambda i, j: -gate[i, j], name="negated")
    exponential = topi.fast_exp(negated)
    out = te.compute(
        (rows, intermediate),
        lambda i, j: (gate[i, j] * up[i, j] / (tirx.const(1, "float32") + exponential[i, j])).astype(
            float_dtype
        ),
        name="swiglu",
    )
    return te.create_prim_func([*inputs, out])


def schedule_swiglu_cpu(func: tirx.PrimFunc, intermediate: int) -> tirx.PrimFunc:
    sch = s_tir.Schedule(func)
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        if sch.get(block).name_hint != "swiglu":
            sch.compute_inline(block)
    _rows_parallel_columns_vectorized(sch, "swiglu", intermediate)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)
