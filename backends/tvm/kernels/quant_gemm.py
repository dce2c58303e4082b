"""Weight-only quantized linear on the CPU as hand-written TIR, the scale applied once per group.

For each strip of `tile` output columns (parallel across cores) and each block of 4 rows:

    part[b, j] = sum over the group's k of x[b, k] * q[k, j]          (raw 4- or 8-bit values)
    acc[b, j] += scale[g, j] * part[b, j]  (+ min[g, j] * sum_k x[b, k], or - scale * zero * sum_k x)

so the inner loop is: load a byte vector, split nibbles, convert, multiply-add into registers.
This is the same sum as x @ dequantize(W).T with the multiplications regrouped (float rounding
differs in the last bits). Layouts: see layouts.py (`int4_tiled`, `tiled`).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from kiln.backends.tvm.kernels.linear import DTYPE_NAMES, QuantSpec

QUANT_TILE = 32  # columns per strip: 4 rows x 32 floats of partial and total sums stay in registers
MANY_ROW_BLOCKS = 4  # from 16 rows on, dequantizing a strip once beats regrouping per row block


def quant_tile(n: int, spec: QuantSpec) -> int | None:
    """The strip width this kernel uses for N outputs, or None when it does not apply."""
    if n % QUANT_TILE or spec.group_size % 2:
        return None
    if (spec.bits, spec.scheme) not in ((4, "min"), (4, "zero_point"), (8, "symmetric"), (8, "min")):
        return None
    return QUANT_TILE


def quant_gemm_kernel(k: int, n: int, spec: QuantSpec, has_bias: bool) -> tirx.PrimFunc:
    tile = QUANT_TILE
    group = spec.group_size
    groups = k // group
    strips = n // tile
    stored = DTYPE_NAMES[spec.scale_dtype]
    four_bit = spec.bits == 4
    packed_k = k // 2 if four_bit else k
    packed_dtype = "uint8" if four_bit else "int8"
    scheme = {"min": 0, "zero_point": 1, "symmetric": 2}[spec.scheme]
    half = group // 2
    many_blocks = MANY_ROW_BLOCKS

    @T.prim_func(s_tir=True)
    def qgemm(
        x_handle: T.handle,
        w_handle: T.handle,
        s_handle: T.handle,
        z_handle: T.handle,
        bias_handle: T.handle,
        counts_handle: T.handle,
        which: T.int64,
        y_handle: T.handle,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        q = T.int64()
        bias_len = T.int64()  # n with a bias; 1 (never read) without
        x = T.match_buffer(x_handle, (q, 4, k), "float32")
        w = T.match_buffer(w_handle, (strips, packed_k, tile), packed_dtype)
        scales = T.match_buffer(s_handle, (strips, groups, tile), stored)
        zeros = T.match_buffer(z_handle, (strips, groups, tile), stored)
        bias = T.match_buffer(bias_handle, (bias_len,), "float32")
        counts = T.match_buffer(counts_handle, (2,), "int64")  # real token rows, real logits rows
        y = T.match_buffer(y_handle, (q, 4, n), "float32")
        group_sums = T.sblock_alloc_buffer((q, 4, groups), "float32")  # sum of x over each group
        if scheme != 2:  # once per call, not once per strip
            for a in T.serial(q):
                with T.sblock("group_sums"):
                    T.reads()
                    T.writes()
                    for b in T.serial(4):
                        for g in T.serial(groups):
                            group_sums[a, b, g] = T.float32(0)
                            for kk in T.serial(group):
                                group_sums[a, b, g] = group_sums[a, b, g] + x[a, b, g * group + kk]
        for jo in T.parallel(strips):
            with T.sblock("strip"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((4, tile), "float32", scope="local")
                part = T.sblock_alloc_buffer((4, tile), "float32", scope="local")
                low = T.sblock_alloc_buffer((tile,), "float32", scope="local")
                high = T.sblock_alloc_buffer((tile,), "float32", scope="local")
                sums = T.sblock_alloc_buffer((4,), "float32", scope="local")
                strip = T.sblock_alloc_buffer((k, tile), "float32", scope="local")
                acc1 = T.sblock_alloc_buffer((tile,), "float32", scope="local")
                part1 = T.sblock_alloc_buffer((tile,), "float32", scope="local")
                sum1 = T.sblock_alloc_buffer((1,), "float32", scope="local")
                if q < T.int64(many_blocks):
                    for a in T.serial(q):
                        if a * 4 + 4 <= counts[which]:
                            for b in T.unroll(4):
                                for lane in T.vectorized(tile):
                                    acc[b, lane] = T.float32(0)
                            for g in T.serial(groups):
                                for b in T.unroll(4):
                                    for lane in T.vectorized(tile):
                                        part[b, lane] = T.float32(0)
                                if four_bit:
                                    for p in T.serial(half):
                                        for lane in T.vectorized(tile):
                                            low[lane] = T.Cast(
                                                "float32", w[jo, g * half + p, lane] & T.uint8(15)
                                            )
                                            high[lane] = T.Cast(
                                                "float32", w[jo, g * half + p, lane] >> T.uint8(4)
                                            )
                                        for b in T.unroll(4):
                                            for lane in T.vectorized(tile):
                                                part[b, lane] = (
                                                    part[b, lane]
                                                    + x[a, b, g * group + 2 * p] * low[lane]
                                                    + x[a, b, g * group + 2 * p + 1] * high[lane]
                                                )
                                else:
                                    for kk in T.serial(group):
                                        for lane in T.vectorized(tile):
                                            low[lane] = T.Cast("float32", w[jo, g * group + kk, lane])
                                        for b in T.unroll(4):
                                            for lane in T.vectorized(tile):
                                                part[b, lane] = (
                                                    part[b, lane] + x[a, b, g * group + kk] * low[lane]
                                                )
                                if scheme == 2:
                                    for b in T.unroll(4):
                                        for lane in T.vectorized(tile):
                                            acc[b, lane] = (
                                                acc[b, lane]
                                                + T.Cast("float32", scales[jo, g, lane]) * part[b, lane]
                                            )
                                else:
                                    for b in T.unroll(4):
                                        sums[b] = group_sums[a, b, g]
                                    if scheme == 0:
                                        for b in T.unroll(4):
                                            for lane in T.vectorized(tile):
                                                acc[b, lane] = (
                                                    acc[b, lane]
                                                    + T.Cast("float32", scales[jo, g, lane]) * part[b, lane]
                                                    + T.Cast("float32", zeros[jo, g, lane]) * sums[b]
                                                )
                                    else:
                                        for b in T.unroll(4):
                                            for lane in T.vectorized(tile):
                                                acc[b, lane] = acc[b, lane] + T.Cast(
                                                    "float32", scales[jo, g, lane]
                                                ) * (
                                                    part[b, lane]
                                                    - T.Cast("float32", zeros[jo, g, lane]) * sums[b]
                                                )
                            for b in T.unroll(4):
                                for lane in T.vectorized(tile):
                                    if has_bias:
                                        y[a, b, jo * tile + lane] = acc[b, lane] + bias[jo * tile + lane]
                                    else:
                                        y[a, b, jo * tile + lane] = acc[b, lane]
                        else:  # the last, partly padded block: only its real rows, one at a time
                            for b in T.serial(T.max(T.int64(0), T.min(T.int64(4), counts[which] - a * 4))):
                                for lane in T.vectorized(tile):
                                    acc1[lane] = T.float32(0)
                                for g in T.serial(groups):
                                    for lane in T.vectorized(tile):
                                        part1[lane] = T.float32(0)
                                    if four_bit:
                                        for p in T.serial(half):
                                            for lane in T.vectorized(tile):
                                                part1[lane] = (
                                                    part1[lane]
                                                    + x[a, b, g * group + 2 * p]
                                                    * T.Cast(
                                                        "float32", w[jo, g * half + p, lane] & T.uint8(15)
                                                    )
                                                    + x[a, b, g * group + 2 * p + 1]
                                                    * T.Cast(
                                                        "float32", w[jo, g * half + p, lane] >> T.uint8(4)
                                                    )
                                                )
                                    else:
                                        for kk in T.serial(group):
                                            for lane in T.vectorized(tile):
                                                part1[lane] = part1[lane] + x[a, b, g * group + kk] * T.Cast(
                                                    "float32", w[jo, g * group + kk, lane]
                                                )
                                    if scheme == 2:
                                        for lane in T.vectorized(tile):
                                            acc1[lane] = (
                                                acc1[lane]
                                                + T.Cast("float32", scales[jo, g, lane]) * part1[lane]
                                            )
                                    else:
                                        sum1[0] = group_sums[a, b, g]
                                        if scheme == 0:
                                            for lane in T.vectorized(tile):
                                                acc1[lane] = (
                                                    acc1[lane]
                                                    + T.Cast("float32", scales[jo, g, lane]) * part1[lane]
                                                    + T.Cast("float32", zeros[jo, g, lane]) * sum1[0]
                                                )
                                        else:
                                            for lane in T.vectorized(tile):
                                                acc1[lane] = acc1[lane] + T.Cast(
                                                    "float32", scales[jo, g, lane]
                                                ) * (
                                                    part1[lane]
                                                    - T.Cast("float32", zeros[jo, g, lane]) * sum1[0]
                                                )
                                for lane in T.vectorized(tile):
                                    if has_bias:
                                        y[a, b, jo * tile + lane] = acc1[lane] + bias[jo * tile + lane]
                                    else:
                                        y[a, b, jo * tile + lane] = acc1[lane]
                            # its padding rows: zeros, not the memory's old contents (often denormal
                            # floats, which the row-wise kernels after this one read 36x slower)
                            for b in T.serial(
                                T.max(T.int64(0), T.min(T.int64(4), counts[which] - a * 4)), T.int64(4)
                            ):
                                for lane in T.vectorized(tile):
                                    y[a, b, jo * tile + lane] = T.float32(0)
                else:  # many rows: dequantize the strip once, then a float32 4-row micro-kernel
                    for kk in T.serial(k):
                        for lane in T.vectorized(tile):
                            if scheme == 0 and not four_bit:
                                strip[kk, lane] = T.Cast("float32", scales[jo, kk // group, lane]) * T.Cast(
                                    "float32", w[jo, kk, lane]
                                ) + T.Cast("float32", zeros[jo, kk // group, lane])
                            elif scheme == 0:
                                strip[kk, lane] = T.Cast("float32", scales[jo, kk // group, lane]) * T.Cast(
                                    "float32",
                                    (w[jo, kk // 2, lane] >> T.Cast("uint8", (kk % 2) * 4)) & T.uint8(15),
                                ) + T.Cast("float32", zeros[jo, kk // group, lane])
                            elif scheme == 1:
                                strip[kk, lane] = T.Cast("float32", scales[jo, kk // group, lane]) * (
                                    T.Cast(
                                        "float32",
                                        (w[jo, kk // 2, lane] >> T.Cast("uint8", (kk % 2) * 4)) & T.uint8(15),
                                    )
                                    - T.Cast("float32", zeros[jo, kk // group, lane])
                                )
                            else:
                                strip[kk, lane] = T.Cast("float32", w[jo, kk, lane]) * T.Cast(
                                    "float32", scales[jo, kk // group, lane]
                                )
                    for a in T.serial(q):
                        for b in T.unroll(4):
                            for lane in T.vectorized(tile):
                                acc[b, lane] = T.float32(0)
                        for kk in T.serial(k):
                            for b in T.unroll(4):
                                for lane in T.vectorized(tile):
                                    acc[b, lane] = acc[b, lane] + x[a, b, kk] * strip[kk, lane]
                        for b in T.unroll(4):
                            for lane in T.vectorized(tile):
                                if has_bias:
                                    y[a, b, jo * tile + lane] = acc[b, lane] + bias[jo * tile + lane]
                                else:
                                    y[a, b, jo * tile + lane] = acc[b, lane]

    return qgemm
