"""The lowering of lora (ir/ops/lora.py): kernels/lora.py's kernel for the target, in place on y.

Its tables are plain arguments of `step` (their LS slots and LR rank symbolic, one pair of symbols for
every table: the runtime allocates them all alike), its rows the padded token rows (T) or logits rows
(L); the kernel skips the padding by the step's row_counts and any row whose slot is -1.
"""

from __future__ import annotations

from tvm import relax, tirx

from kiln.backends.base import BackendError
from kiln.backends.tvm.kernels import lora as lora_kernels
from kiln.backends.tvm.lowerer import ROW_COUNTS, TVM_DTYPES, Lowerer, out_sinfo
from kiln.backends.tvm.lowering_registry import lowering
from kiln.ir import Node, ValueKind


def _own_copy(lw: Lowerer, node: Node) -> relax.Expr:
    """y as the kernel may write it in place: y itself where this node is its only reader (what the
    lora pass makes: the linear's output), else a copy."""
    y = node.inputs[0]
    assert y is not None
    value = lw.value(y)
    graph = lw.graph
    only_reader = len(graph.users().get(y.name, [])) == 1 and all(out.name != y.name for out in graph.outputs)
    if only_reader and y.kind not in (ValueKind.INPUT, ValueKind.PARAM):
        return value
    return lw.emit(relax.op.add(value, relax.const(0, TVM_DTYPES[y.type.dtype])))


@lowering("lora")
def _lora(lw: Lowerer, node: Node) -> list[relax.Expr]:
    y_value, x_value = node.inputs[0], node.inputs[1]
    assert y_value is not None and x_value is not None
    rows = y_value.type.shape[0]
    if rows not in ("T", "L"):
        raise BackendError(f"tvm: lora lowers token (T) or logits (L) rows, not {rows}: {node.describe()}")
    k = int(x_value.type.shape[1])
    sizes = [int(size) for size in node.attrs["sizes"]]
    dtype = TVM_DTYPES[x_value.type.dtype]
    table = node.inputs[3]
    assert table is not None
    table_dtype = TVM_DTYPES[table.type.dtype]
    kernel = lw.kernel(
        "lora",
        (k, tuple(sizes), dtype, table_dtype),
        lambda: lora_kernels.lora_kernel(k, sizes, dtype, lw.target_kind, table_dtype),
        {"k": k, "sizes": sizes},
    )
    which = relax.prim_value(tirx.IntImm("int64", 1 if rows == "L" else 0))
    layer = relax.prim_value(tirx.IntImm("int64", int(node.attrs["layer"])))
    args = [_own_copy(lw, node), *(lw.value(v) for v in node.inputs[1:]), lw.values[ROW_COUNTS], which, layer]
    return [lw.emit(relax.op.call_tir_inplace(kernel, args, [0], [out_sinfo(lw, node)]))]
