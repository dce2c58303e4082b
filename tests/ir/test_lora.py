"""The lora op: its shape rule and its reference against a plain per-row computation."""

from __future__ import annotations

import pytest
import torch

from kiln.ir.ops.lora import lora
from kiln.ir.ops.registry import ShapeError, get_op
from kiln.ir.types import TensorType


def test_the_reference_adds_each_rows_own_adapter_piece_by_piece() -> None:
    generator = torch.Generator().manual_seed(0)
    rows, k, sizes, layers, slots_n, rank = 7, 12, [8, 4], 3, 3, 5
    y, x = torch.randn(rows, sum(sizes), generator=generator), torch.randn(rows, k, generator=generator)
    slots = torch.tensor([0, -1, 2, 2, 1, -1, 0])
    tables = []
    for size in sizes:
        tables += [
            torch.randn(layers, slots_n, rank, k, generator=generator),
            torch.randn(layers, slots_n, rank, size, generator=generator),
        ]
    out = lora(y, x, slots, *tables, layer=1, sizes=sizes)
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            assert torch.equal(out[row], y[row])
            continue
        deltas = [x[row] @ a[1, slot].T @ b[1, slot] for a, b in zip(tables[0::2], tables[1::2], strict=True)]
        torch.testing.assert_close(out[row], y[row] + torch.cat(deltas), rtol=1e-5, atol=1e-5)
        alone = lora(y[row : row + 1], x[row : row + 1], slots[row : row + 1], *tables, layer=1, sizes=sizes)
        assert torch.equal(alone[0], out[row])  # batch invariance


def test_the_shape_rule_refuses_tables_that_do_not_fit() -> None:
    infer = get_op("lora").infer
    y, x, slots = TensorType("f32", ("T", 24)), TensorType("f32", ("T", 16)), TensorType("i64", ("T",))
    a, b = TensorType("f32", (2, "LS", "LR", 16)), TensorType("f32", (2, "LS", "LR", 24))
    assert infer([y, x, slots, a, b], {"layer": 1, "sizes": [24]}) == [y]
    with pytest.raises(ShapeError, match="do not add up"):
        infer([y, x, slots, a, b], {"layer": 1, "sizes": [20]})
    with pytest.raises(ShapeError, match="do not fit x"):
        infer([y, x, slots, TensorType("f32", (2, "LS", "LR", 8)), b], {"layer": 1, "sizes": [24]})
    with pytest.raises(ShapeError, match="a positive int for each"):
        infer([y, x, slots, a, b], {"layer": 1, "sizes": [12, 12]})
