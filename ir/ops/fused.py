"""Ops that passes make by fusing others: split, swiglu, add_rms_norm; also cast and transpose."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ir.ops.basic import rms_norm
from kiln.ir.ops.registry import OpDef, register, require, required
from kiln.ir.types import DTYPES, FLOAT_DTYPES, TensorType, shape_text


def _infer_split(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    x = required(inputs[0], "x")
    sizes = attrs.get("sizes")
    require(
        isinstance(sizes, list) and len(sizes) >= 2 and all(isinstance(s, int) and s > 0 for s in sizes),
        "sizes must list two or more positive ints",
    )
    require(
        x.rank >= 1 and x.shape[-1] == sum(sizes),
        f"sizes {sizes} do not add up to the last dim of {x.text()}",
    )
    return [TensorType(x.dtype, (*x.shape[:-1], size)) for size in sizes]


register(
    OpDef(
        "split",
        (1, 1),
        {"sizes": "lengths of the pieces along the last dim"},
        _infer_split,
        lambda x, *, sizes: tuple(t.contiguous() for t in torch.split(x, sizes, dim=-1)),
        doc="split the last dim into pieces of the given sizes (one output each)",
    )
)


def _infer_swiglu(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    gate = required(inputs[0], "gate")
    require(gate.dtype in FLOAT_DTYPES, f"swiglu expects floats, got {gate.dtype}")
    up = inputs[1] if len(inputs) > 1 else None
    if up is not None:
        require(
            up.shape == gate.shape and up.dtype == gate.dtype, f"gate {gate.text()} and up {up.text()} differ"
        )
        return [TensorType(gate.dtype, gate.shape)]
    last = gate.shape[-1]
    require(
        isinstance(last, int) and last % 2 == 0,
        f"a fused gate|up input needs an even last dim: {gate.text()}",
    )
    return [TensorType(gate.dtype, (*gate.shape[:-1], last // 2))]


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    if up is None:
        gate, up = gate.chunk(2, dim=-1)
    return F.silu(gate) * up


register(
    OpDef(
        "swiglu",
        (1, 2),
        {},
        _infer_swiglu,
        swiglu,
        doc="silu(gate) * up; with one input, gate and up are its two halves along the last dim",
    )
)


def _infer_add_rms_norm(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    x, residual, weight = (
        required(inputs[0], "x"),
        required(inputs[1], "residual"),
        required(inputs[2], "weight"),
    )
    require(
        x.shape == residual.shape and x.dtype == residual.dtype,
        f"x {x.text()} and residual {residual.text()}",
    )
    require(weight.shape == (x.shape[-1],), f"norm weight {shape_text(weight.shape)} does not fit {x.text()}")
    return [TensorType(x.dtype, x.shape), TensorType(x.dtype, x.shape)]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return rms_norm(total, weight, eps=eps), total


register(
    OpDef(
        "add_rms_norm",
        (3, 3),
        {"eps": "added to the mean square"},
        _infer_add_rms_norm,
        add_rms_norm,
        doc="(rms_norm(x + residual) * weight, x + residual)",
    )
)


def _infer_cast(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    x = required(inputs[0], "x")
    require(attrs.get("dtype") in DTYPES, f"dtype must be one of {sorted(DTYPES)}")
    return [TensorType(attrs["dtype"], x.shape)]


register(
    OpDef(
        "cast",
        (1, 1),
        {"dtype": "the dtype to convert to"},
        _infer_cast,
        lambda x, *, dtype: x.to(DTYPES[dtype]),
        doc="convert elements to another dtype",
    )
)


def _infer_transpose(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    x = required(inputs[0], "x")
    perm = attrs.get("perm")
    require(
        isinstance(perm, list) and sorted(perm) == list(range(x.rank)), f"perm {perm} is not a permutation"
    )
    return [TensorType(x.dtype, tuple(x.shape[i] for i in perm))]


register(
    OpDef(
        "transpose",
        (1, 1),
        {"perm": "output dim i is input dim perm[i]"},
        _infer_transpose,
        lambda x, *, perm: x.permute(perm).contiguous(),
        doc="permute dims",
    )
)
