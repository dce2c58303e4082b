"""moe and quantized_moe → route, the experts' grouped matmuls, SwiGLU, combine (kernels/moe.py).

Each projection is one call over the chosen experts only: float experts through kernels/moe.py's
grouped kernel (CPU and CUDA), quantized ones through the integer-dot kernel's experts form (x86
CPUs). Decode reads top_k of the E experts' weights per token.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import relax, tirx

from kiln.backends.base import BackendError
from kiln.backends.tvm.kernels import int_dot
from kiln.backends.tvm.kernels import linear as linear_kernels
from kiln.backends.tvm.kernels import moe as moe_kernels
from kiln.backends.tvm.layouts import tiled_transform
from kiln.backends.tvm.lowerer import ROW_BLOCK, ROW_COUNTS, Lowerer, row_blocks
from kiln.backends.tvm.lowering_registry import lowering
from kiln.backends.tvm.ops_basic import swiglu_call
from kiln.backends.tvm.ops_quant import dot_weights, factored_scales, scale_run
from kiln.ir import Node
from kiln.ir.ops.moe import quantized_inputs


class Routing:
    """One moe node's routing results and row counts, for its projections' calls."""

    def __init__(self, lw: Lowerer, node: Node, experts: int) -> None:
        x_value, logits = node.inputs[0], node.inputs[1]
        assert x_value is not None and logits is not None
        self.experts = experts
        self.top_k = int(node.attrs["top_k"])
        normalize = bool(node.attrs["normalize"])
        self.blocks = row_blocks(lw, node)
        self.rows = self.blocks * ROW_BLOCK
        self.which = relax.prim_value(tirx.IntImm("int64", 1 if x_value.type.shape[0] == "L" else 0))
        kernel = lw.kernel(
            "moe_route",
            (experts, self.top_k, normalize),
            lambda: moe_kernels.route_kernel(experts, self.top_k, normalize, lw.target_kind),
            {},
        )
        outs = [
            relax.TensorType([self.rows, self.top_k], "int32"),
            relax.TensorType([self.rows, self.top_k], "float32"),
            relax.TensorType([self.rows * self.top_k], "int32"),
            relax.TensorType([experts + 1], "int32"),
        ]
        args = [lw.value(logits), lw.values[ROW_COUNTS], self.which]
        call = lw.emit(relax.call_tir(kernel, args, outs))
        _, self.weights, self.order, self.offsets = (lw.emit(relax.TupleGetItem(call, i)) for i in range(4))


# (projection, its input rows, slot_input, routing) -> its output rows [rows * top_k, N]
Project = Callable[[str, relax.Expr, bool, Routing], relax.Expr]


def _lower_block(lw: Lowerer, node: Node, experts: int, inner: int, project: Project) -> list[relax.Expr]:
    x_value = node.inputs[0]
    assert x_value is not None
    hidden = int(x_value.type.shape[1])
    routing = Routing(lw, node, experts)
    x = lw.value(x_value)
    gate = project("gate", x, False, routing)
    up = project("up", x, False, routing)
    slots = routing.rows * routing.top_k
    hidden_states = swiglu_call(lw, [gate, up], relax.TensorType([slots, inner], "float32"), "f32")
    down = project("down", hidden_states, True, routing)
    top_k = routing.top_k
    kernel = lw.kernel(
        "moe_combine",
        (hidden, top_k),
        lambda: moe_kernels.combine_kernel(hidden, top_k, lw.target_kind),
        {},
    )
    args = [down, routing.weights, lw.values[ROW_COUNTS], routing.which]
    return [lw.emit(relax.call_tir(kernel, args, relax.TensorType([routing.rows, hidden], "float32")))]


def _check_float(node: Node) -> None:
    x_value = node.inputs[0]
    if x_value is None or x_value.type.dtype != "f32":
        raise BackendError(f"tvm: {node.op} takes float32 activations here: {node.describe()}")


@lowering("moe")
def _moe(lw: Lowerer, node: Node) -> list[relax.Expr]:
    _check_float(node)
    stacked = dict(zip(("gate", "up", "down"), node.inputs[2:5], strict=True))
    experts, inner, _ = (int(d) for d in stacked["gate"].type.shape)  # type: ignore[union-attr]

    def project(part: str, rows_in: relax.Expr, slot_input: bool, routing: Routing) -> relax.Expr:
        value = stacked[part]
        assert value is not None
        _, n, k = (int(d) for d in value.type.shape)
        tile = linear_kernels.column_tile(n)
        weight = lw.param(value, tiled_transform(tile), (experts * n // tile, k, tile))
        top_k = routing.top_k
        kernel = lw.kernel(
            "moe_grouped",
            (k, n, tile, experts, top_k, slot_input),
            lambda: moe_kernels.grouped_kernel(k, n, tile, experts, top_k, slot_input, lw.target_kind),
            {},
        )
        args = [rows_in, weight, routing.order, routing.offsets]
        return lw.emit(relax.call_tir(kernel, args, relax.TensorType([routing.rows * top_k, n], "float32")))

    return _lower_block(lw, node, experts, inner, project)


@lowering("quantized_moe")
def _quantized_moe(lw: Lowerer, node: Node) -> list[relax.Expr]:
    _check_float(node)
    parts = quantized_inputs(node.inputs)
    isa = lw.int_dot
    if lw.target_kind != "cpu" or isa is None:
        raise BackendError(
            "tvm: quantized_moe runs on x86 CPUs with AVX2 or better (the integer-dot kernels): "
            + node.describe(),
            hint="build without --quantization to run float experts, or use --backend reference",
        )
    gate_q = parts["gate"][0]
    assert gate_q is not None
    experts, inner = int(gate_q.type.shape[0]), int(gate_q.type.shape[1])

    def project(part: str, rows_in: relax.Expr, slot_input: bool, routing: Routing) -> relax.Expr:
        qweight, scales, zeros = parts[part]
        assert qweight is not None and scales is not None
        layout = node.attrs[part]
        bits, group = int(layout["bits"]), int(layout["group_size"])
        spec = linear_kernels.QuantSpec(bits, group, str(layout["scheme"]), scales.type.dtype)
        n, k = int(scales.type.shape[1]), int(scales.type.shape[2]) * group
        tile = int_dot.int_dot_tile(n, spec, isa)
        plane = int_dot.weight_plane(spec, layout.get("value_bits"))
        if tile is None or plane is None:
            raise BackendError(
                f"tvm: no integer-dot kernel for the {part} experts ({bits} bits, {layout['scheme']}, "
                f"group {group}, {n} outputs): {node.describe()}",
                hint="int8 or int4 re-quantization (--quantization int8) has kernels for every size "
                f"that is a multiple of {isa.lanes}",
            )
        per = scale_run(layout.get("scale_block"), group, k)
        weights = dot_weights(lw, qweight, bits, str(layout["packing"]), tile, plane)
        if per:
            scale_args = factored_scales(lw, scales, tile, per)
            zero_args = factored_scales(lw, zeros, tile, per) if zeros is not None else scale_args
        else:
            shape = (experts * n // tile, k // group, tile)
            scale_args = [lw.param(scales, tiled_transform(tile), shape)] * 2
            zero_args = (
                [lw.param(zeros, tiled_transform(tile), shape)] * 2 if zeros is not None else scale_args
            )
        top_k = routing.top_k
        kernel = lw.kernel(
            f"qdot_experts_{isa.name}",
            (k, n, bits, group, layout["scheme"], scales.type.dtype, plane, per, experts, top_k, slot_input),
            lambda: int_dot.int_dot_gemm_kernel(
                k,
                n,
                spec,
                False,
                isa,
                plane,
                scale_per=per,
                experts=experts,
                top_k=top_k,
                slot_input=slot_input,
            ),
            {},
        )
        in_blocks = routing.blocks * (top_k if slot_input else 1)
        x3 = lw.emit(relax.op.reshape(rows_in, [in_blocks, ROW_BLOCK, k]))
        args = [
            x3,
            *weights,
            *scale_args,
            *zero_args,
            lw.values[ROW_COUNTS],
            routing.which,
            routing.order,
            routing.offsets,
        ]
        slot_blocks = routing.blocks * top_k
        y3 = lw.emit(relax.call_tir(kernel, args, relax.TensorType([slot_blocks, ROW_BLOCK, n], "float32")))
        return lw.emit(relax.op.reshape(y3, [slot_blocks * ROW_BLOCK, n]))

    return _lower_block(lw, node, experts, inner, project)
