"""Lowering rules for an image encoder's ops: layer_norm, gelu, quick_gelu and the dense attention over
one image's rows (keys past `num_rows` masked, the padding rows' results zero, as the reference)."""

from __future__ import annotations

import math

import numpy as np

from kiln.backends.onnx.context import LoweringContext
from kiln.backends.onnx.ops_basic import in_float32, input_name
from kiln.backends.onnx.rules import rule
from kiln.ir import Node


@rule("layer_norm")
def _layer_norm(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    weight, bias = input_name(ctx, node, 1), input_name(ctx, node, 2)
    eps = float(node.attrs["eps"])

    def normalize(x: str) -> str:
        return ctx.b.op("LayerNormalization", x, weight, bias, axis=-1, epsilon=eps)

    in_float32(ctx, node, normalize, outputs)
    return "onnx LayerNormalization"


@rule("gelu")
def _gelu(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    def gelu(x: str) -> str:  # 0.5 x (1 + erf(x / sqrt 2))
        erf = ctx.b.op("Erf", ctx.b.op("Mul", x, ctx.b.const(1 / math.sqrt(2.0), np.float32)))
        half_x = ctx.b.op("Mul", x, ctx.b.const(0.5, np.float32))
        return ctx.b.op("Mul", half_x, ctx.b.op("Add", erf, ctx.b.const(1.0, np.float32)))

    in_float32(ctx, node, gelu, outputs)
    return "onnx Erf, Mul, Add"


@rule("quick_gelu")
def _quick_gelu(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    def quick_gelu(x: str) -> str:
        return ctx.b.op("Mul", x, ctx.b.op("Sigmoid", ctx.b.op("Mul", x, ctx.b.const(1.702, np.float32))))

    in_float32(ctx, node, quick_gelu, outputs)
    return "onnx Sigmoid, Mul"


@rule("attention")
def _attention(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    if node.outputs[0].type.dtype != "f32":
        raise ValueError("attention lowers float32 only")
    q, k, v = (input_name(ctx, node, i) for i in range(3))
    heads_first = [1, 0, 2]
    scores = ctx.b.op(
        "MatMul", ctx.b.op("Transpose", q, perm=heads_first), ctx.b.op("Transpose", k, perm=[1, 2, 0])
    )
    scores = ctx.b.op("Mul", scores, ctx.b.const(float(node.attrs["scale"]), np.float32))  # [H, T, T]
    has_count = len(node.inputs) > 3 and node.inputs[3] is not None
    if has_count:
        rows = ctx.b.op("Gather", ctx.b.op("Shape", q), ctx.b.const(0), axis=0)
        index = ctx.b.op("Range", ctx.b.const(0), rows, ctx.b.const(1))
        real = ctx.b.op("Less", index, input_name(ctx, node, 3))  # [T]
        scores = ctx.b.op("Where", real, scores, ctx.b.const(-np.inf, np.float32))
    probs = ctx.b.op("Softmax", scores, axis=-1)
    attended = ctx.b.op("MatMul", probs, ctx.b.op("Transpose", v, perm=heads_first))
    if not has_count:
        ctx.b.node("Transpose", [attended], outputs, perm=heads_first)
        return "onnx MatMul, Softmax"
    out = ctx.b.op("Transpose", attended, perm=heads_first)
    row_mask = ctx.b.op("Reshape", real, ctx.b.const([-1, 1, 1]))
    ctx.b.node("Where", [row_mask, out, ctx.b.const(0.0, np.float32)], outputs)
    return "onnx MatMul, Softmax (masked)"
