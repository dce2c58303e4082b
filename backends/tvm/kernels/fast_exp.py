"""exp(x) as vector arithmetic in TIR, for loops LLVM vectorizes: libm's expf is one call a lane.

The TIR-expression counterpart of `topi.fast_exp` (the same method; that one takes TE tensors only,
as rowwise.py's SwiGLU uses it).

Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, then Cephes' degree-6 polynomial for e^r and
2^n from the exponent bits: within 2 ulp of expf on [-86, 88]. Inputs are clamped to that range, so
anything below gives about 4e-38 (not 0: callers mask what must be 0) and nothing overflows.
"""

from __future__ import annotations

from typing import Any

from tvm.script import tirx as T

Expr = Any  # a TIR expression

LOWEST = -86.0  # 2^n stays a normal float (n >= -125): no denormals
HIGHEST = 88.0
LOG2E = 1.44269504088896341
LN2_HIGH = 0.693359375  # ln 2 in two parts: n * LN2_HIGH is exact for |n| <= 127
LN2_LOW = -2.12194440e-4
# e^r = 1 + r + r^2 p(r), p's coefficients from the highest power
POLYNOMIAL = (
    1.9875691500e-4,
    1.3981999507e-3,
    8.3334519073e-3,
    4.1665795894e-2,
    1.6666665459e-1,
    5.0000001201e-1,
)


def fast_exp(x: Expr) -> Expr:
    """e^x for a float32 expression, built from vectorizable operations only."""
    clamped = T.max(T.min(x, T.float32(HIGHEST)), T.float32(LOWEST))
    n = T.floor(clamped * T.float32(LOG2E) + T.float32(0.5))
    r = clamped - n * T.float32(LN2_HIGH) - n * T.float32(LN2_LOW)
    poly = T.float32(POLYNOMIAL[0])
    for coefficient in POLYNOMIAL[1:]:
        poly = poly * r + T.float32(coefficient)
    e_r = poly * r * r + r + T.float32(1)
    two_n = T.reinterpret("float32", T.shift_left(T.Cast("int32", n) + 127, 23))
    return e_r * two_n
