"""lora: a batched low-rank update of a linear's output, each row by its own adapter (or none).

The adapters are data: tables indexed by [layer, slot] that the runtime writes when it loads an adapter
(ir/step.py LORA_* inputs), so one compiled step serves any adapters of rank up to the tables' R.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kiln.ir.ops.basic import linear_rows
from kiln.ir.ops.registry import OpDef, register, require, required
from kiln.ir.types import FLOAT_DTYPES, TensorType, shape_text

MAX_LORA_PIECES = 4  # a fused linear's pieces with adapters of their own (q|k|v, gate|up)


def _infer_lora(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    y, x, slots = required(inputs[0], "y"), required(inputs[1], "x"), required(inputs[2], "slots")
    require(
        y.dtype in FLOAT_DTYPES and x.dtype == y.dtype,
        f"y {y.text()} and x {x.text()} must be one float dtype",
    )
    require(
        y.rank == 2 and x.rank == 2 and y.shape[0] == x.shape[0], f"y {y.text()} and x {x.text()} need [T, n]"
    )
    require(slots.dtype == "i64" and slots.shape == (x.shape[0],), f"slots {slots.text()} must be i64 [T]")
    tables = inputs[3:]
    sizes = attrs.get("sizes")
    require(
        isinstance(sizes, list)
        and all(isinstance(s, int) and s > 0 for s in sizes)
        and len(tables) == 2 * len(sizes),
        f"sizes {sizes!r} must list a positive int for each (a, b) pair of tables ({len(tables)} tables)",
    )
    require(y.shape[1] == sum(sizes), f"sizes {sizes} do not add up to y's columns {shape_text(y.shape)}")
    require(isinstance(attrs.get("layer"), int) and attrs["layer"] >= 0, "layer must be an int >= 0")
    for size, a, b in zip(sizes, tables[0::2], tables[1::2], strict=True):
        a, b = required(a, "a"), required(b, "b")
        require(
            a.rank == 4 and b.rank == 4, f"tables a {a.text()} and b {b.text()} must be [layers, S, ., .]"
        )
        require(
            a.dtype == b.dtype
            and a.dtype in FLOAT_DTYPES
            and a.shape[3] == x.shape[1]
            and b.shape[3] == size,
            f"tables a {a.text()}, b {b.text()} do not fit x {x.text()} and a piece of {size} columns",
        )
        require(
            a.shape[:3] == b.shape[:3],
            f"tables a {a.text()} and b {b.text()} differ",
        )
    return [TensorType(y.dtype, y.shape)]


def lora(
    y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, *tables: torch.Tensor, layer: int, sizes: list[int]
) -> torch.Tensor:
    """Rows of one slot together, each through `linear_rows` (so a row's result does not depend on its
    batch); the pieces' columns follow one another in y."""
    out = y.clone()
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    if any(a.shape[2] == 0 for a in tables[0::2]):  # rank 0: no update (and linear_rows needs K > 0)
        return out
    for slot in torch.unique(slots[slots >= 0]).tolist():
        rows = torch.nonzero(slots == slot).flatten()
        for start, size, a, b in zip(starts, sizes, tables[0::2], tables[1::2], strict=True):
            low_rank = linear_rows(x[rows], a[layer, slot].to(x.dtype))
            delta = linear_rows(low_rank, b[layer, slot].to(x.dtype).T)
            out[rows, start : start + size] += delta
    return out


register(
    OpDef(
        "lora",
        (5, 3 + 2 * MAX_LORA_PIECES),
        {
            "layer": "the index into the tables' first dim",
            "sizes": "y's columns in pieces, one (a, b) pair of tables each",
        },
        _infer_lora,
        lora,
        doc="(y, x, slots, a0, b0, a1, b1, ...) -> y + per piece (x @ a[layer, slot].T) @ b[layer, slot] "
        "for rows with slot >= 0; a[layers, S, R, K], b[layers, S, R, N_piece] (scale folded into b; any "
        "float dtype, computed in x's)",
    )
)
