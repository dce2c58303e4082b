"""Linear layers as TIR: y[q, 4, N] = x[q, 4, K] @ W[K, N], float or weight-only quantized.

Rows come in blocks of 4 (the executable pads the token count), so the register-blocked inner loop
has no tail predicate whatever the token count. Weights are stored K-major ("kn"), transposed once at
load, so a vector of output columns reads contiguous weights. Quantized weights are dequantized inside
the reduction (one kernel), a 64-column strip at a time, into a stack tile.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, te, tirx

ROW_BLOCK = 4

DTYPE_NAMES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class QuantSpec:
    bits: int
    group_size: int
    scheme: str  # symmetric | zero_point | min
    scale_dtype: str = "f32"  # scales and zeros are stored in this dtype (GGUF: f16), used as float32


def column_tile(n: int) -> int:
    for tile in (64, 32, 16, 8):
        if n % tile == 0:
            return tile
    return 1


def _dequantized(spec: QuantSpec, k: int, n: int, dtype: str) -> tuple[list[te.Tensor], te.Tensor]:
    """Placeholders for the K-major quantized layout and the float weight [K, N] they stand for."""
    groups = k // spec.group_size
    tile = column_tile(n)
    stored = DTYPE_NAMES[spec.scale_dtype]
    scale_input = te.placeholder((n // tile, groups, tile), stored, name="scales")
    scales = te.compute(
        (groups, n), lambda g, j: scale_input[j // tile, g, j % tile].astype(dtype), name="scales_f32"
    )
    if spec.bits == 4:
        packed = te.placeholder((n // tile, k // 2, tile), "uint8", name="qweight")

        def value(kk, j):
            byte = packed[j // tile, kk // 2, j % tile]
            return (
                (byte >> (tirx.Cast("uint8", kk % 2) * tirx.const(4, "uint8"))) & tirx.const(15, "uint8")
            ).astype(dtype)

    else:
        packed = te.placeholder((n // tile, k, tile), "int8", name="qweight")

        def value(kk, j):
            return packed[j // tile, kk, j % tile].astype(dtype)

    if spec.scheme == "symmetric":
        weight = te.compute(
            (k, n), lambda kk, j: value(kk, j) * scales[kk // spec.group_size, j], name="dequantize"
        )
        return [packed, scale_input], weight
    zero_input = te.placeholder((n // tile, groups, tile), stored, name="zeros")
    zeros = te.compute(
        (groups, n), lambda g, j: zero_input[j // tile, g, j % tile].astype(dtype), name="zeros_f32"
    )
    if spec.scheme == "zero_point":
        weight = te.compute(
            (k, n),
            lambda kk, j: scales[kk // spec.group_size, j] * (value(kk, j) - zeros[kk // spec.group_size, j]),
            name="dequantize",
        )
    else:
        weight = te.compute(
            (k, n),
            lambda kk, j: scales[kk // spec.group_size, j] * value(kk, j) + zeros[kk // spec.group_size, j],
            name="dequantize",
        )
    return [packed, scale_input, zero_input], weight


def linear_kernel(
    k: int, n: int, dtype: str = "f32", quant: QuantSpec | None = None, has_bias: bool = False
) -> tirx.PrimFunc:
    """The unscheduled kernel: params (x, weight tensors..., [bias], y)."""
    float_dtype = DTYPE_NAMES[dtype]
    rows = tirx.Var("q", "int64")
    x = te.placeholder((rows, ROW_BLOCK, k), float_dtype, name="x")
    if quant is None:
        tile = column_tile(n)
        strips = te.placeholder((n // tile, k, tile), float_dtype, name="weight")
        weight = te.compute((k, n), lambda kk, j: strips[j // tile, kk, j % tile], name="weight_kn")
        weight_args = [strips]
    else:
        weight_args, weight = _dequantized(quant, k, n, "float32")
    reduce = te.reduce_axis((0, k), name="k")
    accumulate = "float32"
    product = te.compute(
        (rows, ROW_BLOCK, n),
        lambda a, b, j: te.sum(
            x[a, b, reduce].astype(accumulate) * weight[reduce, j].astype(accumulate), axis=reduce
        ),
        name="linear",
    )
    args = [x, *weight_args]
    if has_bias:
        bias = te.placeholder((n,), float_dtype, name="bias")
        out = te.compute(
            (rows, ROW_BLOCK, n), lambda a, b, j: (product[a, b, j] + bias[j]).astype(float_dtype), name="out"
        )
        args.append(bias)
    else:
        out = te.compute(
            (rows, ROW_BLOCK, n), lambda a, b, j: product[a, b, j].astype(float_dtype), name="out"
        )
    func = te.create_prim_func([*args, out])
    return func


def schedule_linear_cpu(func: tirx.PrimFunc, n: int, quant: QuantSpec | None) -> tirx.PrimFunc:
    """Columns in vector strips (parallel across cores), 4 rows x strip accumulated in registers."""
    sch = s_tir.Schedule(func)
    block = sch.get_sblock("linear")
    tile = column_tile(n)
    a, b, j, k = sch.get_loops(block)
    jo, ji = sch.split(j, [None, tile])
    sch.reorder(jo, a, k, b, ji)
    sch.parallel(jo)
    if tile > 1:
        sch.vectorize(ji)
    sch.unroll(b)
    if quant is None:
        sch.compute_inline(sch.get_sblock("weight_kn"))
    else:
        sch.compute_inline(sch.get_sblock("scales_f32"))
        if quant.scheme != "symmetric":
            sch.compute_inline(sch.get_sblock("zeros_f32"))
        weight_block = sch.get_sblock("dequantize")
        sch.compute_at(weight_block, k)
        inner = sch.get_loops(weight_block)[-1]
        if tile > 1:
            sch.vectorize(inner)
    write_back = sch.cache_write(block, 0, "local")
    sch.reverse_compute_inline(sch.get_sblock("out"))  # bias and cast happen on the way out of registers
    sch.reverse_compute_at(write_back, a)
    sch.decompose_reduction(block, k)
    if tile > 1:
        sch.vectorize(sch.get_loops(write_back)[-1])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)
