"""Lowerings of an image encoder's ops as Relax ops (legalized and scheduled like the rest): layer_norm,
gelu, quick_gelu, and the dense attention over one image's rows, keys past `num_rows` masked out and
the padding rows' results zero (as the reference)."""

from __future__ import annotations

from typing import Any

import numpy as np
from tvm import relax

from kiln.backends.base import BackendError
from kiln.backends.tvm.kernels import dense_attention
from kiln.backends.tvm.lowerer import TVM_DTYPES, Lowerer
from kiln.backends.tvm.lowering_registry import lowering
from kiln.ir import Node


@lowering("layer_norm")
def _layer_norm(lw: Lowerer, node: Node) -> list[relax.Expr]:
    x, weight, bias = (lw.value(v) for v in node.inputs)
    eps = float(node.attrs["eps"])
    return [lw.emit(relax.op.nn.layer_norm(x, weight, bias, axes=[-1], epsilon=eps))]


@lowering("gelu")
def _gelu(lw: Lowerer, node: Node) -> list[relax.Expr]:
    return [lw.emit(relax.op.nn.gelu(lw.value(node.inputs[0])))]


@lowering("quick_gelu")
def _quick_gelu(lw: Lowerer, node: Node) -> list[relax.Expr]:
    x = lw.value(node.inputs[0])
    dtype = TVM_DTYPES[node.outputs[0].type.dtype]
    gate = relax.op.sigmoid(relax.op.multiply(x, relax.const(1.702, dtype)))
    return [lw.emit(relax.op.multiply(x, gate))]


@lowering("attention")
def _attention(lw: Lowerer, node: Node) -> list[relax.Expr]:
    q_type = node.outputs[0].type
    if q_type.dtype != "f32":
        raise BackendError(f"tvm: attention lowers float32 only: {node.describe()}")
    if lw.target_kind == "cpu":
        return _attention_cpu(lw, node)
    q, k, v = (lw.value(value) for value in node.inputs[:3])
    rows = lw.dim(q_type.shape[0])
    f32 = TVM_DTYPES["f32"]
    heads_first = [1, 0, 2]
    scores = relax.op.matmul(relax.op.permute_dims(q, heads_first), relax.op.permute_dims(k, [1, 2, 0]))
    scores = relax.op.multiply(scores, relax.const(float(node.attrs["scale"]), f32))  # [H, T, T]
    num_rows = lw.value(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    if num_rows is not None:
        index = lw.emit(relax.op.arange(0, rows, dtype="int64"))
        real = lw.emit(relax.op.less(index, num_rows))  # [T]
        scores = relax.op.where(real, scores, relax.const(float("-inf"), f32))
    probs = relax.op.nn.softmax(scores, axis=-1)
    out = relax.op.permute_dims(relax.op.matmul(probs, relax.op.permute_dims(v, heads_first)), heads_first)
    if num_rows is not None:
        out = relax.op.where(relax.op.reshape(real, [rows, 1, 1]), out, relax.const(0.0, f32))
    return [lw.emit(out)]


def _attention_cpu(lw: Lowerer, node: Node) -> list[relax.Expr]:
    """Scores and weighted values as batched matrix products, a masked softmax between them
    (kernels/dense_attention.py): no unscheduled loops on the CPU."""
    q_type = node.outputs[0].type
    _, heads, head_dim = q_type.shape
    heads, head_dim = int(heads), int(head_dim)
    static = q_type.shape[0] if isinstance(q_type.shape[0], int) else None
    rows = lw.dim(q_type.shape[0])
    q, k, v = (lw.value(value) for value in node.inputs[:3])
    f32 = TVM_DTYPES["f32"]
    heads_first = [1, 0, 2]
    num_rows = lw.value(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    if num_rows is None:
        if static is None:
            raise BackendError(f"tvm: attention over a symbolic row count needs num_rows: {node.describe()}")
        num_rows = relax.const(np.array([static], np.int64), "int64")

    def matmul(x: relax.Expr, w: relax.Expr, inner: int | None, n: int | None, out_n: Any) -> relax.Expr:
        kernel = lw.kernel(
            "batched_matmul",
            (static, inner, n, heads),
            lambda: dense_attention.batched_matmul_kernel(static, inner, n, heads),
            {"n": n},
        )
        return lw.emit(relax.call_tir(kernel, [x, w], relax.TensorType([heads, rows, out_n], f32)))

    scores = matmul(
        lw.emit(relax.op.permute_dims(q, heads_first)),
        lw.emit(relax.op.permute_dims(k, [1, 2, 0])),
        head_dim,
        static,
        rows,
    )
    scale = float(node.attrs["scale"])
    softmax = lw.kernel(
        "masked_softmax",
        (static, heads, scale),
        lambda: dense_attention.masked_softmax_kernel(static, heads, scale),
        {"rows": static},
    )
    probs = lw.emit(relax.call_tir(softmax, [scores, num_rows], relax.TensorType([heads, rows, rows], f32)))
    mixed = matmul(probs, lw.emit(relax.op.permute_dims(v, heads_first)), static, head_dim, head_dim)
    out = relax.op.permute_dims(mixed, heads_first)
    if len(node.inputs) > 3 and node.inputs[3] is not None:  # padding query rows give zeros
        real = relax.op.less(relax.op.arange(0, rows, dtype="int64"), num_rows)
        out = relax.op.where(relax.op.reshape(real, [rows, 1, 1]), out, relax.const(0.0, f32))
    return [lw.emit(out)]
