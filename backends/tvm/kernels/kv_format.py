"""How the attention kernels store K/V in the cache and read it back: as the activations' dtype, or
float8 e4m3 with a per-tensor scale (the semantics of ir/ops/attention.py `to_cache` / `from_cache`)."""

from __future__ import annotations

from typing import Any

from tvm.script import tirx as T

from kiln.ir.ops.attention import FP8_MAX

FP8 = "float8_e4m3fn"
Expr = Any  # a TIR expression


def stored(value: Expr, cache_dtype: str, scale: Expr) -> Expr:
    """A K or V element as the cache holds it: value / scale saturated to +-448 for float8."""
    if cache_dtype == FP8:
        scaled = T.Cast("float32", value) / scale
        return T.Cast(FP8, T.max(T.min(scaled, T.float32(FP8_MAX)), T.float32(-FP8_MAX)))
    return value


def loaded(element: Expr, cache_dtype: str, scale: Expr) -> Expr:
    """A cached K or V element as float32: times its scale for float8."""
    if cache_dtype == FP8:
        return T.Cast("float32", element) * scale
    return T.Cast("float32", element)
