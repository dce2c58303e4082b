"""The quantized_linear lowering and the weight layouts of the quantized kernels (also used by the
quantized experts in ops_moe.py)."""

from __future__ import annotations

import math

import numpy as np
from tvm import relax, tirx

from kiln.backends.base import BackendError
from kiln.backends.tvm.kernels import int_dot, quant_gemm
from kiln.backends.tvm.kernels import linear as linear_kernels
from kiln.backends.tvm.layouts import dot_transform, factored_transform, int4_tiled_transform, tiled_transform
from kiln.backends.tvm.lowerer import ROW_BLOCK, ROW_COUNTS, Lowerer, rows_of
from kiln.backends.tvm.lowering_registry import lowering
from kiln.ir import Node, Value


@lowering("quantized_linear")
def _quantized_linear(lw: Lowerer, node: Node) -> list[relax.Expr]:
    x_value, qweight, scales, zeros = (*node.inputs, None, None)[:4]
    bias = node.inputs[4] if len(node.inputs) > 4 else None
    bits, group, scheme, packing = (node.attrs[a] for a in ("bits", "group_size", "scheme", "packing"))
    supported = (bits, scheme) in ((4, "zero_point"), (4, "min"), (8, "symmetric"), (8, "min"))
    if not supported:
        raise BackendError(
            f"tvm: quantized_linear with {bits} bits, scheme {scheme} has no kernel: {node.describe()}"
        )
    assert x_value is not None and qweight is not None and scales is not None
    n = int(qweight.type.shape[0])
    k = int(x_value.type.shape[-1])
    dtype = x_value.type.dtype
    if dtype != "f32" and lw.target_kind == "cpu":  # GPUs: float16/bfloat16 in and out, float32 sums
        raise BackendError(
            f"tvm: quantized_linear takes float32 activations on CPUs, not {dtype}: {node.describe()}",
            hint="compile quantized models for CPU targets with --dtype f32 (the default)",
        )
    spec = linear_kernels.QuantSpec(int(bits), int(group), str(scheme), scales.type.dtype)
    x3, blocks = rows_of(lw, node, lw.value(x_value), k)
    leading = x_value.type.shape[0]
    which = relax.prim_value(tirx.IntImm("int64", 1 if leading == "L" else 0))
    isa = lw.int_dot
    dot_tile = int_dot.int_dot_tile(n, spec, isa) if isa is not None else None
    group_tile = quant_gemm.quant_tile(n, spec) if lw.target_kind == "cpu" else None
    tile = dot_tile or group_tile or linear_kernels.column_tile(n)
    # the int-dot kernel's factored scales
    per = scale_run(node.attrs.get("scale_block"), int(group), k) if dot_tile is not None else 0
    if not per:
        scale_param = lw.param(scales, tiled_transform(tile), (n // tile, k // group, tile))
        zero_param = (
            lw.param(zeros, tiled_transform(tile), (n // tile, k // group, tile))
            if zeros is not None
            else None
        )
    bias_arg = lw.value(bias) if bias is not None else None
    key = (k, n, bits, group, scheme, scales.type.dtype, bias is not None)
    if dot_tile is not None or group_tile is not None:  # hand-written: fixed signature, unused inputs unread
        last = [
            relax.const(np.zeros(1, dtype=np.float32)) if bias_arg is None else bias_arg,
            lw.values[ROW_COUNTS],
            which,
        ]
        if dot_tile is not None and isa is not None:
            plane = int_dot.weight_plane(spec, node.attrs.get("value_bits"))
            assert plane is not None
            weight_args = dot_weights(lw, qweight, int(bits), str(packing), dot_tile, plane)
            if per:
                scale_args = factored_scales(lw, scales, tile, per)
                zero_args = factored_scales(lw, zeros, tile, per) if zeros is not None else scale_args
                tail = [*scale_args, *zero_args, *last]
            else:
                zero_arg = scale_param if zero_param is None else zero_param
                tail = [scale_param, scale_param, zero_arg, zero_arg, *last]
            activation_bits = lw.activation_bits
            kernel = lw.kernel(
                f"qdot_{isa.name}" + ("_a8" if activation_bits == 8 else ""),
                (*key, plane, per, activation_bits),
                lambda: int_dot.int_dot_gemm_kernel(
                    k, n, spec, bias is not None, isa, plane, activation_bits=activation_bits, scale_per=per
                ),
                {},
            )
        else:
            weight_args = [_strip_weights(lw, qweight, int(bits), str(packing), tile)]
            tail = [scale_param, scale_param if zero_param is None else zero_param, *last]
            kernel = lw.kernel(
                "qgemm", key, lambda: quant_gemm.quant_gemm_kernel(k, n, spec, bias is not None), {}
            )
        args = [x3, *weight_args, *tail]
    else:
        args = [
            x3,
            _strip_weights(lw, qweight, int(bits), str(packing), tile),
            scale_param,
            *([zero_param] if zero_param is not None else []),
            *([bias_arg] if bias_arg is not None else []),
        ]
        kernel = lw.kernel(
            "qlinear",
            key,
            lambda: linear_kernels.linear_kernel(k, n, dtype, spec, bias is not None),
            {"k": k, "n": n, "quant": spec},
        )
    out_type = relax.TensorType([blocks, ROW_BLOCK, n], linear_kernels.DTYPE_NAMES[dtype])
    y3 = lw.emit(relax.call_tir(kernel, args, out_type))
    return [lw.emit(relax.op.reshape(y3, [blocks * ROW_BLOCK, n]))]


def _strip_weights(lw: Lowerer, qweight: Value, bits: int, packing: str, tile: int) -> relax.Expr:
    """The float32 quantized kernels' weights: strips of `tile` columns (layouts.py `int4_tiled`, `tiled`)."""
    n, packed_k = int(qweight.type.shape[0]), int(qweight.type.shape[1])
    if bits == 4:
        return lw.param(qweight, int4_tiled_transform(packing, tile), (n // tile, packed_k, tile))
    return lw.param(qweight, tiled_transform(tile), (n // tile, packed_k, tile))


def dot_weights(
    lw: Lowerer, qweight: Value, bits: int, packing: str, tile: int, plane: int_dot.Plane
) -> list[relax.Expr]:
    """The integer-dot kernel's weight planes (layouts.py `dot_tiled`, `dot_high`): main, high.
    Stacked experts [E, N, K'] are E * N rows."""
    n = math.prod(int(d) for d in qweight.type.shape[:-1])
    k = int(qweight.type.shape[-1]) * (2 if bits == 4 else 1)
    rows = k // (8 if plane.nibbles else 4)
    dtype = "u8" if plane.nibbles else "i8"
    main = lw.param(
        qweight,
        dot_transform("dot_tiled", bits, packing, tile, plane.bits, plane.offset),
        (n // tile, rows, tile * 4),
        dtype,
    )
    if plane.bits in (4, 8):
        return [main, main]
    high = lw.param(
        qweight,
        dot_transform("dot_high", bits, packing, tile, plane.bits, plane.offset),
        (n // tile, rows // plane.pairs_a_high_row, tile * 4),
        dtype,
    )
    return [main, high]


def scale_run(scale_block: int | None, group: int, k: int) -> int:
    """Groups a factored scale's float16 spans (the IR's `scale_block` hint), 0 where the scales stay
    a float a group (no hint, a run of one group, or K not whole runs)."""
    per = int(scale_block) // group if scale_block else 0
    return per if per > 1 and (k // group) % per == 0 else 0


def factored_scales(lw: Lowerer, scales: Value, tile: int, per: int) -> list[relax.Expr]:
    """Scales (or mins) as [int8 a group, float16 a run of `per` groups] (layouts.py `factored_*`)."""
    n, groups = math.prod(int(d) for d in scales.type.shape[:-1]), int(scales.type.shape[-1])
    sub = lw.param(scales, factored_transform("sub", tile, per), (n // tile, groups, tile), "i8")
    above = lw.param(scales, factored_transform("super", tile, per), (n // tile, groups // per, tile), "f16")
    return [sub, above]


@lowering("quantized_embedding")
def _quantized_embedding(lw: Lowerer, node: Node) -> list[relax.Expr]:
    """Rows of the quantized table at the ids, dequantized after the gather: a token reads its row's
    bytes only. The table stays in its import layout (4-bit values two a byte), K-quant scales factored
    as for the integer-dot kernels (an int8 a group times a float16 a super-block)."""
    ids, qweight, scales = node.inputs[:3]
    zeros = node.inputs[3] if len(node.inputs) > 3 else None
    assert ids is not None and qweight is not None and scales is not None
    bits, group, scheme, packing = (node.attrs[a] for a in ("bits", "group_size", "scheme", "packing"))
    vocab, k = int(qweight.type.shape[0]), int(node.outputs[0].type.shape[-1])
    groups = k // int(group)
    tokens = [lw.dim(d) for d in node.outputs[0].type.shape[:-1]]
    index = lw.value(ids)

    def rows(table: relax.Expr) -> relax.Expr:
        return lw.emit(relax.op.take(table, index, axis=0, mode="clip"))

    packed = rows(lw.param(qweight))
    if bits == 4:
        low = relax.op.bitwise_and(packed, relax.const(15, "uint8"))
        high = relax.op.right_shift(packed, relax.const(4, "uint8"))
        if packing == "pairs":  # element 2i low, 2i + 1 high
            values = relax.op.stack([low, high], axis=-1)
        else:  # gguf: per 32, element j low and j + 16 high
            halves = [*tokens, k // 32, 16]
            values = relax.op.concat([relax.op.reshape(low, halves), relax.op.reshape(high, halves)], axis=-1)
    else:
        values = packed
    grouped = lw.emit(relax.op.reshape(relax.op.astype(values, "float32"), [*tokens, groups, int(group)]))
    per = scale_run(node.attrs.get("scale_block"), int(group), k)

    def group_floats(value: Value) -> relax.Expr:
        """[*tokens, groups, 1] float32: each group's scale (or zero, or min) of the rows read."""
        if not per:
            picked = rows(lw.param(value))
            return relax.op.expand_dims(relax.op.astype(picked, "float32"), -1)
        sub = rows(lw.param(value, factored_transform("sub", 1, per), (vocab, groups, 1), "i8"))
        above = rows(lw.param(value, factored_transform("super", 1, per), (vocab, groups // per, 1), "f16"))
        runs = relax.op.astype(relax.op.repeat(above, per, axis=-2), "float32")
        return relax.op.multiply(runs, relax.op.astype(sub, "float32"))

    scale = group_floats(scales)
    if scheme == "symmetric":
        weight = relax.op.multiply(grouped, scale)
    elif scheme == "zero_point":
        assert zeros is not None
        weight = relax.op.multiply(scale, relax.op.subtract(grouped, group_floats(zeros)))
    else:
        assert zeros is not None
        weight = relax.op.add(relax.op.multiply(scale, grouped), group_floats(zeros))
    return [lw.emit(relax.op.reshape(weight, [*tokens, k]))]
