"""Lowerings of the float ops: linear, norms, elementwise ops, SwiGLU, shape ops, embeddings and the
tensor-parallel collectives."""

from __future__ import annotations

import math

import numpy as np
from tvm import relax

from kiln.backends.base import BackendError
from kiln.backends.tvm.kernels import linear as linear_kernels
from kiln.backends.tvm.kernels import rowwise
from kiln.backends.tvm.layouts import tiled_transform
from kiln.backends.tvm.lowerer import ROW_BLOCK, TVM_DTYPES, Lowerer, out_sinfo, rows_of
from kiln.backends.tvm.lowering_registry import lowering
from kiln.ir import Node


@lowering("linear")
def _linear(lw: Lowerer, node: Node) -> list[relax.Expr]:
    weight_value = node.inputs[1]
    assert weight_value is not None and weight_value.kind.value == "param"
    n, k = (int(d) for d in weight_value.type.shape)
    dtype = weight_value.type.dtype
    has_bias = len(node.inputs) > 2 and node.inputs[2] is not None
    x3, blocks = rows_of(lw, node, lw.value(node.inputs[0]), k)
    tile = linear_kernels.column_tile(n)
    weight = lw.param(weight_value, tiled_transform(tile), (n // tile, k, tile))
    args = [x3, weight] + ([lw.value(node.inputs[2])] if has_bias else [])
    kernel = lw.kernel(
        "linear",
        (k, n, dtype, has_bias),
        lambda: linear_kernels.linear_kernel(k, n, dtype, None, has_bias),
        {"k": k, "n": n, "quant": None},
    )
    y3 = lw.emit(relax.call_tir(kernel, args, relax.TensorType([blocks, ROW_BLOCK, n], TVM_DTYPES[dtype])))
    return [lw.emit(relax.op.reshape(y3, [blocks * ROW_BLOCK, n]))]


def _rms_norm_call(lw: Lowerer, node: Node, with_residual: bool) -> list[relax.Expr]:
    x_value = node.inputs[0]
    assert x_value is not None
    if x_value.type.rank != 2 and (with_residual or x_value.type.rank < 2):
        raise BackendError(f"tvm: {node.op} lowers 2-D [rows, hidden] inputs: {node.describe()}")
    hidden = int(x_value.type.shape[-1])
    dtype = x_value.type.dtype
    eps = float(node.attrs["eps"])
    kernel = lw.kernel(
        "rms_norm",
        (hidden, eps, dtype, with_residual),
        lambda: rowwise.rms_norm_kernel(hidden, eps, dtype, with_residual),
        {"hidden": hidden, "with_residual": with_residual},
    )
    args = [lw.value(v) for v in node.inputs]
    outs = [out_sinfo(lw, node, i) for i in range(len(node.outputs))]
    if x_value.type.rank > 2:  # per-head norms (Qwen3's q and k): rows x heads rows of head_dim
        rows = math.prod([lw.dim(d) for d in x_value.type.shape[:-1]])
        flat = lw.emit(relax.op.reshape(args[0], [rows, hidden]))
        flat_type = relax.TensorType([rows, hidden], outs[0].dtype)
        normed = lw.emit(relax.call_tir(kernel, [flat, *args[1:]], flat_type))
        return [lw.emit(relax.op.reshape(normed, [lw.dim(d) for d in x_value.type.shape]))]
    call = lw.emit(relax.call_tir(kernel, args, outs if with_residual else outs[0]))
    if not with_residual:
        return [call]
    return [lw.emit(relax.TupleGetItem(call, 0)), lw.emit(relax.TupleGetItem(call, 1))]


@lowering("rms_norm")
def _rms_norm(lw: Lowerer, node: Node) -> list[relax.Expr]:
    return _rms_norm_call(lw, node, with_residual=False)


@lowering("add_rms_norm")
def _add_rms_norm(lw: Lowerer, node: Node) -> list[relax.Expr]:
    return _rms_norm_call(lw, node, with_residual=True)


@lowering("embedding")
def _embedding(lw: Lowerer, node: Node) -> list[relax.Expr]:
    return [lw.emit(relax.op.take(lw.value(node.inputs[0]), lw.value(node.inputs[1]), axis=0, mode="clip"))]


@lowering("embedding_with_rows")
def _embedding_with_rows(lw: Lowerer, node: Node) -> list[relax.Expr]:
    """Rows of the table at ids < V, of the image rows at ids >= V (id - V); a zero row after the image
    rows keeps every take in range when a step has none."""
    weight_value = node.inputs[0]
    assert weight_value is not None
    vocab, hidden = (int(d) for d in weight_value.type.shape)
    dtype = TVM_DTYPES[weight_value.type.dtype]
    weight, ids, rows = (lw.value(v) for v in node.inputs)
    in_vocab = relax.op.take(weight, ids, axis=0, mode="clip")
    padded = relax.op.concat([rows, relax.op.zeros(relax.ShapeExpr([1, hidden]), dtype)], axis=0)
    extra = relax.op.take(padded, relax.op.subtract(ids, relax.const(vocab, "int64")), axis=0, mode="clip")
    is_extra = relax.op.expand_dims(relax.op.greater_equal(ids, relax.const(vocab, "int64")), -1)
    return [lw.emit(relax.op.where(is_extra, extra, in_vocab))]


@lowering("take_rows")
def _take_rows(lw: Lowerer, node: Node) -> list[relax.Expr]:
    return [lw.emit(relax.op.take(lw.value(node.inputs[0]), lw.value(node.inputs[1]), axis=0, mode="clip"))]


@lowering("reshape")
def _reshape(lw: Lowerer, node: Node) -> list[relax.Expr]:
    shape = [lw.dim(d) for d in node.outputs[0].type.shape]
    return [lw.emit(relax.op.reshape(lw.value(node.inputs[0]), shape))]


@lowering("add")
def _add(lw: Lowerer, node: Node) -> list[relax.Expr]:
    return [lw.emit(relax.op.add(lw.value(node.inputs[0]), lw.value(node.inputs[1])))]


@lowering("mul")
def _mul(lw: Lowerer, node: Node) -> list[relax.Expr]:
    return [lw.emit(relax.op.multiply(lw.value(node.inputs[0]), lw.value(node.inputs[1])))]


@lowering("silu")
def _silu(lw: Lowerer, node: Node) -> list[relax.Expr]:
    return [lw.emit(relax.op.nn.silu(lw.value(node.inputs[0])))]


@lowering("gelu_tanh")
def _gelu_tanh(lw: Lowerer, node: Node) -> list[relax.Expr]:
    return [lw.emit(relax.op.nn.gelu_tanh(lw.value(node.inputs[0])))]


@lowering("scale")
def _scale(lw: Lowerer, node: Node) -> list[relax.Expr]:
    dtype = TVM_DTYPES[node.outputs[0].type.dtype]
    factor = relax.const(float(node.attrs["factor"]), dtype)
    return [lw.emit(relax.op.multiply(lw.value(node.inputs[0]), factor))]


@lowering("softcap")
def _softcap(lw: Lowerer, node: Node) -> list[relax.Expr]:
    dtype = TVM_DTYPES[node.outputs[0].type.dtype]
    cap = float(node.attrs["cap"])
    bounded = relax.op.tanh(relax.op.divide(lw.value(node.inputs[0]), relax.const(cap, dtype)))
    return [lw.emit(relax.op.multiply(bounded, relax.const(cap, dtype)))]


def swiglu_call(lw: Lowerer, args: list[relax.Expr], out: relax.TensorType, dtype: str) -> relax.Expr:
    """silu(gate) * up of `args` (gate and up, or one gate|up): the CPU's row kernel, elsewhere Relax
    ops; `out` is the [rows, intermediate] result."""
    fused = len(args) == 1
    if lw.target_kind != "cpu":
        if fused:
            halves = lw.emit(relax.op.split(args[0], 2, axis=-1))
            args = [lw.emit(relax.TupleGetItem(halves, 0)), lw.emit(relax.TupleGetItem(halves, 1))]
        return lw.emit(relax.op.multiply(relax.op.nn.silu(args[0]), args[1]))
    intermediate = int(out.shape[1])
    kernel = lw.kernel(
        "swiglu",
        (intermediate, dtype, fused),
        lambda: rowwise.swiglu_kernel(intermediate, dtype, fused),
        {"intermediate": intermediate},
    )
    return lw.emit(relax.call_tir(kernel, args, out))


@lowering("swiglu")
def _swiglu(lw: Lowerer, node: Node) -> list[relax.Expr]:
    out_type = node.outputs[0].type
    if lw.target_kind == "cpu" and out_type.rank != 2:
        raise BackendError(f"tvm: swiglu lowers 2-D [rows, features] inputs: {node.describe()}")
    args = [lw.value(v) for v in node.inputs if v is not None]
    return [swiglu_call(lw, args, out_sinfo(lw, node), out_type.dtype)]


@lowering("split")
def _split(lw: Lowerer, node: Node) -> list[relax.Expr]:
    sizes = [int(s) for s in node.attrs["sizes"]]
    cuts = list(np.cumsum(sizes)[:-1].tolist())
    pieces = lw.emit(relax.op.split(lw.value(node.inputs[0]), cuts, axis=-1))
    return [lw.emit(relax.TupleGetItem(pieces, i)) for i in range(len(sizes))]


@lowering("cast")
def _cast(lw: Lowerer, node: Node) -> list[relax.Expr]:
    return [lw.emit(relax.op.astype(lw.value(node.inputs[0]), TVM_DTYPES[str(node.attrs["dtype"])]))]


@lowering("transpose")
def _transpose(lw: Lowerer, node: Node) -> list[relax.Expr]:
    return [lw.emit(relax.op.permute_dims(lw.value(node.inputs[0]), [int(p) for p in node.attrs["perm"]]))]


@lowering("all_reduce")
def _all_reduce(lw: Lowerer, node: Node) -> list[relax.Expr]:
    world = relax.prim_value(int(node.attrs["world"]))  # type: ignore[arg-type]
    x = lw.value(node.inputs[0])
    return [lw.emit(relax.call_dps_packed("kiln.all_reduce", [x, world], out_sinfo(lw, node)))]


@lowering("all_gather")
def _all_gather(lw: Lowerer, node: Node) -> list[relax.Expr]:
    world = relax.prim_value(int(node.attrs["world"]))  # type: ignore[arg-type]
    dim = relax.prim_value(int(node.attrs["dim"]))  # type: ignore[arg-type]
    x = lw.value(node.inputs[0])
    return [lw.emit(relax.call_dps_packed("kiln.all_gather", [x, world, dim], out_sinfo(lw, node)))]


@lowering("shard_embedding")
def _shard_embedding(lw: Lowerer, node: Node) -> list[relax.Expr]:
    """take of the ids inside [vocab_start, vocab_start + rows), zero rows for the others."""
    table, ids = lw.value(node.inputs[0]), lw.value(node.inputs[1])
    rows = int(node.inputs[0].type.shape[0])  # type: ignore[union-attr]
    start = lw.value(node.inputs[2])
    local = lw.emit(relax.op.subtract(ids, start))
    inside = lw.emit(
        relax.op.logical_and(
            relax.op.greater_equal(local, relax.const(0, "int64")),
            relax.op.less(local, relax.const(rows, "int64")),
        )
    )
    clipped = lw.emit(relax.op.where(inside, local, relax.const(0, "int64")))
    looked_up = lw.emit(relax.op.take(table, clipped, axis=0, mode="clip"))
    dtype = TVM_DTYPES[node.outputs[0].type.dtype]
    mask = lw.emit(relax.op.astype(relax.op.expand_dims(inside, -1), dtype))
    return [lw.emit(relax.op.multiply(looked_up, mask))]
