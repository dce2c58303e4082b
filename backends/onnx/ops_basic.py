"""Lowering rules for the elementwise, shape, embedding, linear and normalisation ops."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from kiln.backends.onnx.builder import ONNX_DTYPES
from kiln.backends.onnx.context import LoweringContext
from kiln.backends.onnx.rules import rule
from kiln.ir import Node, Value


def input_name(ctx: LoweringContext, node: Node, index: int) -> str:
    value = node.inputs[index]
    assert value is not None
    return ctx.name(value)


def _optional(ctx: LoweringContext, node: Node, index: int) -> str | None:
    value = node.inputs[index] if index < len(node.inputs) else None
    return ctx.name(value) if value is not None else None


@rule("add")
def _add(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    ctx.b.node("Add", [input_name(ctx, node, 0), input_name(ctx, node, 1)], outputs)
    return "onnx Add"


@rule("mul")
def _mul(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    ctx.b.node("Mul", [input_name(ctx, node, 0), input_name(ctx, node, 1)], outputs)
    return "onnx Mul"


def silu(ctx: LoweringContext, x: str, outputs: list[str] | int = 1) -> str:
    (out,) = ctx.b.node("Mul", [x, ctx.b.op("Sigmoid", x)], outputs)
    return out


@rule("silu")
def _silu(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    silu(ctx, input_name(ctx, node, 0), outputs)
    return "onnx Sigmoid, Mul"


def in_float32(ctx: LoweringContext, node: Node, compute: Callable[[str], str], outputs: list[str]) -> None:
    """outputs = compute(input 0 as float32), cast back to the node's dtype."""
    dtype = _dtype(node)
    x = input_name(ctx, node, 0)
    result = compute(ctx.b.op("Cast", x, to=ONNX_DTYPES["f32"]) if dtype != "f32" else x)
    if dtype != "f32":
        result = ctx.b.op("Cast", result, to=ONNX_DTYPES[dtype])
    ctx.b.node("Identity", [result], outputs)


@rule("gelu_tanh")
def _gelu_tanh(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    def gelu(x: str) -> str:  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
        cube = ctx.b.op("Mul", ctx.b.op("Mul", x, x), x)
        inner = ctx.b.op("Add", x, ctx.b.op("Mul", cube, ctx.b.const(0.044715, np.float32)))
        root = ctx.b.const(math.sqrt(2.0 / math.pi), np.float32)
        one_plus = ctx.b.op(
            "Add", ctx.b.const(1.0, np.float32), ctx.b.op("Tanh", ctx.b.op("Mul", inner, root))
        )
        return ctx.b.op("Mul", ctx.b.op("Mul", x, one_plus), ctx.b.const(0.5, np.float32))

    in_float32(ctx, node, gelu, outputs)
    return "onnx Mul, Add, Tanh"


@rule("scale")
def _scale(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    factor = float(node.attrs["factor"])
    in_float32(ctx, node, lambda x: ctx.b.op("Mul", x, ctx.b.const(factor, np.float32)), outputs)
    return "onnx Mul"


@rule("softcap")
def _softcap(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    cap = float(node.attrs["cap"])

    def bounded(x: str) -> str:
        tanh = ctx.b.op("Tanh", ctx.b.op("Div", x, ctx.b.const(cap, np.float32)))
        return ctx.b.op("Mul", tanh, ctx.b.const(cap, np.float32))

    in_float32(ctx, node, bounded, outputs)
    return "onnx Div, Tanh, Mul"


@rule("reshape")
def _reshape(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    shape = node.attrs["shape"]
    assert isinstance(shape, list)
    target = [d if isinstance(d, int) else -1 for d in shape]  # a symbol is the one dim left to infer
    ctx.b.node("Reshape", [input_name(ctx, node, 0), ctx.b.const(target)], outputs)
    return "onnx Reshape"


@rule("embedding")
def _embedding(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    ctx.b.node("Gather", [input_name(ctx, node, 0), input_name(ctx, node, 1)], outputs, axis=0)
    return "onnx Gather"


@rule("embedding_with_rows")
def _embedding_with_rows(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    """Rows of the table at ids < V, of the image rows at ids >= V (id - V); a zero row after the image
    rows keeps every gather in range when a step has none."""
    weight_value = node.inputs[0]
    assert weight_value is not None
    vocab, hidden = (int(d) for d in weight_value.type.shape)
    weight, ids, rows = (input_name(ctx, node, i) for i in range(3))
    in_vocab = ctx.b.op("Gather", weight, ctx.b.op("Min", ids, ctx.b.const(vocab - 1)), axis=0)
    padded = ctx.b.op("Concat", rows, ctx.b.const(np.zeros((1, hidden)), np.float32), axis=0)
    extra_index = ctx.b.op("Max", ctx.b.op("Sub", ids, ctx.b.const(vocab)), ctx.b.const(0))
    extra = ctx.b.op("Gather", padded, extra_index, axis=0)
    is_extra = ctx.b.op("Unsqueeze", ctx.b.op("GreaterOrEqual", ids, ctx.b.const(vocab)), ctx.b.const([1]))
    ctx.b.node("Where", [is_extra, extra, in_vocab], outputs)
    return "onnx Gather, Where"


@rule("take_rows")
def _take_rows(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    ctx.b.node("Gather", [input_name(ctx, node, 0), input_name(ctx, node, 1)], outputs, axis=0)
    return "onnx Gather"


RowsFn = Callable[[str, list[str] | int], str]


def matmul_2d(ctx: LoweringContext, x: Value, lower_2d: RowsFn, outputs: list[str]) -> None:
    """Run `lower_2d(rows [M, K]) -> [M, N]` on x[..., K], reshaping around it when x is not 2-D."""
    name = ctx.name(x)
    if x.type.rank == 2:
        lower_2d(name, outputs)
        return
    rows = ctx.b.op("Reshape", name, ctx.b.const([-1, int(x.type.shape[-1])]))
    flat = lower_2d(rows, 1)
    lead = ctx.b.op("Shape", name, end=-1)
    shape = ctx.b.op("Concat", lead, ctx.b.const([-1]), axis=0)
    ctx.b.node("Reshape", [flat, shape], outputs)


@rule("linear")
def _linear(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    x = node.inputs[0]
    assert x is not None
    weight, bias = input_name(ctx, node, 1), _optional(ctx, node, 2)

    def gemm(rows: str, outs: list[str] | int) -> str:
        inputs = [rows, weight] + ([bias] if bias is not None else [])
        (out,) = ctx.b.node("Gemm", inputs, outs, transB=1)
        return out

    matmul_2d(ctx, x, gemm, outputs)
    return "onnx Gemm"


def rms_norm(ctx: LoweringContext, x: str, dtype: str, weight: str, eps: float, outputs: list[str]) -> None:
    """weight * (x / sqrt(mean(x^2) + eps)) in float32: the pattern ONNX Runtime fuses into
    SimplifiedLayerNormalization."""
    wide = ctx.b.op("Cast", x, to=ONNX_DTYPES["f32"]) if dtype != "f32" else x
    square = ctx.b.op("Pow", wide, ctx.b.const(2.0, np.float32))
    mean = ctx.b.op("ReduceMean", square, ctx.b.const([-1]), keepdims=1)
    root = ctx.b.op("Sqrt", ctx.b.op("Add", mean, ctx.b.const(eps, np.float32)))
    normed = ctx.b.op("Div", wide, root)
    if dtype != "f32":
        normed = ctx.b.op("Cast", normed, to=ONNX_DTYPES[dtype])
    ctx.b.node("Mul", [normed, weight], outputs)


def _dtype(node: Node, index: int = 0) -> str:
    value = node.inputs[index]
    assert value is not None
    return value.type.dtype


@rule("rms_norm")
def _rms_norm(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    eps = node.attrs["eps"]
    assert isinstance(eps, float)
    rms_norm(ctx, input_name(ctx, node, 0), _dtype(node), input_name(ctx, node, 1), eps, outputs)
    return "onnx Pow, ReduceMean, Sqrt, Div, Mul"


@rule("add_rms_norm")
def _add_rms_norm(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    eps = node.attrs["eps"]
    assert isinstance(eps, float)
    normed, total = outputs
    ctx.b.node("Add", [input_name(ctx, node, 0), input_name(ctx, node, 1)], [total])
    rms_norm(ctx, total, _dtype(node), input_name(ctx, node, 2), eps, [normed])
    return "onnx Add, Pow, ReduceMean, Sqrt, Div, Mul"


@rule("split")
def _split(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    sizes = node.attrs["sizes"]
    ctx.b.node("Split", [input_name(ctx, node, 0), ctx.b.const(sizes)], outputs, axis=-1)
    return "onnx Split"


@rule("swiglu")
def _swiglu(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    gate, up = input_name(ctx, node, 0), _optional(ctx, node, 1)
    if up is None:
        gate, up = ctx.b.node("Split", [gate], 2, axis=-1, num_outputs=2)
    ctx.b.node("Mul", [silu(ctx, gate), up], outputs)
    return "onnx Sigmoid, Mul"


@rule("cast")
def _cast(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    dtype = node.attrs["dtype"]
    assert isinstance(dtype, str)
    ctx.b.node("Cast", [input_name(ctx, node, 0)], outputs, to=ONNX_DTYPES[dtype])
    return "onnx Cast"


@rule("transpose")
def _transpose(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    ctx.b.node("Transpose", [input_name(ctx, node, 0)], outputs, perm=node.attrs["perm"])
    return "onnx Transpose"
