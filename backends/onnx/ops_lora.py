"""Lowering of `lora` (ir/ops/lora.py): each row's adapter update from the run-time tables, in plain ONNX.

Per piece g of the op (its columns of y), with the layer's tables A = a_g[layer] [S, R, K] and
B = b_g[layer] [S, R, N_g] seen as [S*R, K] and [S*R, N_g] (rows slot-major):

    h     = Gemm(x, A, transB=1)     [rows, S*R]: each row through every slot's down-projection
    h     = Where(mask, h, 0)        mask[row, c] = slots[row] == c // R: its own slot's columns only
    delta = Gemm(h, B)               [rows, N_g]
    out   = y + Concat(deltas)

Nothing larger than [rows, S*R] besides the deltas, no per-row copy of a table. A row of slot -1 (or of
no slot in the tables) keeps no column of h, so its delta is exactly 0 and it comes out y (a non-finite
value in another slot's rows cannot reach it either). With S = 0 or R = 0 (empty tables) h has no
columns and the second Gemm gives zeros."""

from __future__ import annotations

import numpy as np

from kiln.backends.onnx.builder import ONNX_DTYPES
from kiln.backends.onnx.context import LoweringContext
from kiln.backends.onnx.ops_basic import input_name
from kiln.backends.onnx.rules import rule
from kiln.ir import Node


def _slot_mask(ctx: LoweringContext, slots: str, a: str) -> str:
    """[rows, S*R] bool: column c of h belongs to the row's slot (c // R == slots[row])."""
    b = ctx.b
    num_slots = b.op("Shape", a, start=1, end=2)
    rank = b.op("Shape", a, start=2, end=3)
    columns = b.op("Squeeze", b.op("Mul", num_slots, rank), b.const([0]))
    # ONNX Runtime checks the divisor even for an empty dividend: R = 0 (no columns) divides by 1
    divisor = b.op("Max", b.op("Squeeze", rank, b.const([0])), b.const(1))
    column_slot = b.op("Div", b.op("Range", b.const(0), columns, b.const(1)), divisor)
    return b.op("Equal", b.op("Unsqueeze", slots, b.const([1])), column_slot)


def _zero(ctx: LoweringContext, dtype: str) -> str:
    zero = ctx.b.const(0.0, np.float32)
    return zero if dtype == "f32" else ctx.b.op("Cast", zero, to=ONNX_DTYPES[dtype])


@rule("lora")
def _lora(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    x_value = node.inputs[1]
    assert x_value is not None
    dtype, in_features = x_value.type.dtype, int(x_value.type.shape[1])
    layer, sizes = node.attrs["layer"], node.attrs["sizes"]
    assert isinstance(layer, int) and isinstance(sizes, list)
    b = ctx.b
    y, x, slots = (input_name(ctx, node, i) for i in range(3))
    zero = ctx.cached(("lora_zero", dtype), lambda: _zero(ctx, dtype))
    at_layer = b.const(layer)  # a 0-d index: Gather drops the layers dim
    deltas = []
    for piece, size in enumerate(sizes):
        a, b_table = input_name(ctx, node, 3 + 2 * piece), input_name(ctx, node, 4 + 2 * piece)
        mask = ctx.cached(("lora_mask", slots, a), lambda a=a: _slot_mask(ctx, slots, a))
        down, up = b.op("Gather", a, at_layer, axis=0), b.op("Gather", b_table, at_layer, axis=0)
        table = node.inputs[3 + 2 * piece]
        assert table is not None
        if table.type.dtype != dtype:  # tables stored narrower than the activations: this layer's, widened
            down, up = (b.op("Cast", t, to=ONNX_DTYPES[dtype]) for t in (down, up))
        down = b.op("Reshape", down, b.const([-1, in_features]))  # [S*R, K]
        up = b.op("Reshape", up, b.const([-1, int(size)]))  # [S*R, N_g]
        low_rank = b.op("Where", mask, b.op("Gemm", x, down, transB=1), zero)
        deltas.append(b.op("Gemm", low_rank, up))
    delta = deltas[0] if len(deltas) == 1 else b.op("Concat", *deltas, axis=-1)
    b.node("Add", [y, delta], outputs)
    return "onnx Gemm, Where (each row's slot of the run-time tables)"
