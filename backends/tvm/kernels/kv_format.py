"""How the attention kernels store K/V in the cache and read it back: as a float dtype (the activations',
or a narrower one: a cast each way), or float8 e4m3 with a per-tensor scale (the semantics of
ir/ops/attention.py `to_cache` / `from_cache`).

On CPUs float8 is converted here, bit by bit: TVM 0.27's LLVM lowering of float8_e4m3fn casts gets
subnormals wrong both ways (2^-9 read back as 0.0088, 3 * 2^-9 stored as 0). CUDA's conversion
instructions are exact, so the CUDA kernels keep the plain casts (`native=True`).
"""

from __future__ import annotations

from typing import Any

from tvm.script import tirx as T

from kiln.ir.ops.attention import FP8_MAX

FP8 = "float8_e4m3fn"
Expr = Any  # a TIR expression
SMALLEST_NORMAL = 2.0**-6  # float8 e4m3: below, subnormals in steps of 2^-9
EXPONENT_SHIFT = (127 - 7) << 3  # float32 minus float8 exponent bias, in the float8 code's bit position


def stored(value: Expr, cache_dtype: str, scale: Expr, native: bool = False) -> Expr:
    """A K or V element as the cache holds it: value / scale saturated to +-448 for float8, rounded to
    nearest, ties to even (a plain cast to the other float dtypes)."""
    if cache_dtype != FP8:
        return T.Cast(cache_dtype, value)
    scaled = T.max(T.min(T.Cast("float32", value) / scale, T.float32(FP8_MAX)), T.float32(-FP8_MAX))
    if native:
        return T.Cast(FP8, scaled)
    magnitude = T.abs(scaled)
    bits = T.reinterpret("int32", magnitude)
    # round the 23-bit mantissa to 3 bits, ties to even; the carry moves into the exponent
    rounded = (bits + 0x7FFFF + T.bitwise_and(T.shift_right(bits, 20), 1)) >> 20
    subnormal = T.Cast("int32", T.nearbyint(magnitude * T.float32(2.0**9)))  # ties to even
    code = T.Select(magnitude < T.float32(SMALLEST_NORMAL), subnormal, rounded - EXPONENT_SHIFT)
    signed = T.Select(T.reinterpret("int32", scaled) < 0, T.bitwise_or(code, 0x80), code)  # -0 too
    return T.reinterpret(FP8, T.Cast("uint8", signed))


def loaded(element: Expr, cache_dtype: str, scale: Expr, native: bool = False) -> Expr:
    """A cached K or V element as float32: times its scale for float8."""
    if cache_dtype != FP8:
        return T.Cast("float32", element)
    if native:
        return T.Cast("float32", element) * scale
    code = T.Cast("int32", T.reinterpret("uint8", element))
    unsigned = T.bitwise_and(code, 0x7F)
    normal = T.reinterpret("float32", T.shift_left(unsigned + EXPONENT_SHIFT, 20))
    magnitude = T.Select(unsigned < 8, T.Cast("float32", unsigned) * T.float32(2.0**-9), normal)
    return T.Select(code >= 0x80, -magnitude, magnitude) * scale
