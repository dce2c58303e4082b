"""Lowerings of an image encoder's ops as Relax ops (legalized and scheduled like the rest): layer_norm,
gelu, quick_gelu, and the dense attention over one image's rows, keys past `num_rows` masked out and
the padding rows' results zero (as the reference)."""

from __future__ import annotations

from tvm import relax

from kiln.backends.base import BackendError
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
