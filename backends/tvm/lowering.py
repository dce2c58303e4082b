"""IR graph → one Relax function `step`, with one lowering per IR op.

Signature of `step` (the executable pads the token rows and logits rows to multiples of 4, so the
register-blocked kernels need no tail predicate; `tq` and `lq` count blocks of 4):

    step(token_ids[tq, 4], positions[tq, 4], slot_mapping[tq, 4], block_tables[B, MB], seq_lens[B],
         query_start_loc[B1], logits_indices[lq, 4], kv_cache[layers, 2, NB, BS, kv_heads, head_dim],
         *weights) -> logits[lq * 4, vocab]

On the CPU a second function, `decode`, has the same inputs and params with `tq` = `lq` = 1 (at most 4
token rows and 4 logits rows: single-stream decode); it shares the generic kernels with `step`, except
where a kernel specialized to those rows exists (`DecodeKernels`: the tuned ones, see tuning.py).

Weights are parameters (the library holds none), each in the layout its kernel reads (`ParamSpec`).
An op without a lowering, or with attributes a lowering cannot take, fails naming the op and the
model line it came from.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tvm import relax, tirx

from kiln.backends.base import BackendError
from kiln.backends.tvm.kernels import attention as attention_kernels
from kiln.backends.tvm.kernels import attention_cuda as attention_cuda_kernels
from kiln.backends.tvm.kernels import int_dot, quant_gemm, rowwise
from kiln.backends.tvm.kernels import linear as linear_kernels
from kiln.backends.tvm.kernels.kv_format import FP8
from kiln.backends.tvm.layouts import (
    dot_transform,
    factored_transform,
    int4_tiled_transform,
    tiled_transform,
)
from kiln.ir import KV_CACHE_INPUT, STEP_INPUT_TYPES, Graph, Node, TensorType, Value
from kiln.ir.ops.attention import rope_inv_freq

ROW_BLOCK = linear_kernels.ROW_BLOCK
PADDED_INPUTS = ("token_ids", "positions", "slot_mapping", "logits_indices")
_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "i64": "int64", "i32": "int32"}
_DTYPES |= {"u8": "uint8", "i8": "int8", "bool": "bool", "f8e4m3": FP8}


@dataclass(frozen=True)
class ParamSpec:
    """A `step` parameter: IR weight `source` after layout `transform` (see layouts.py)."""

    name: str
    source: str
    transform: str
    shape: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "transform": self.transform,
            "shape": list(self.shape),
            "dtype": self.dtype,
        }


KernelBuilder = Callable[[], tirx.PrimFunc]
Schedule = Callable[[str, tirx.PrimFunc, dict[str, Any]], tuple[tirx.PrimFunc, str]]
# (kind, key, the generic unscheduled kernel, info) -> (a kernel for the decode rows, origin) or None
DecodeKernels = Callable[
    [str, tuple[Any, ...], tirx.PrimFunc, dict[str, Any]], tuple[tirx.PrimFunc, str] | None
]
DECODE_BLOCKS = 1  # tq and lq of `decode`


@dataclass
class Lowerer:
    """State while lowering one graph: the Relax builder, values, params and kernels made so far."""

    graph: Graph
    target_kind: str  # "cpu" | "cuda"
    schedule: Schedule
    builder: relax.BlockBuilder = field(default_factory=relax.BlockBuilder)
    dims: dict[str, Any] = field(default_factory=dict)
    values: dict[str, relax.Expr] = field(default_factory=dict)
    params: dict[tuple[str, str], relax.Var] = field(default_factory=dict)
    param_specs: list[ParamSpec] = field(default_factory=list)
    kernels: dict[tuple[Any, ...], relax.GlobalVar] = field(default_factory=dict)
    kernel_origins: dict[str, str] = field(default_factory=dict)
    decode_kernels: DecodeKernels | None = None  # set while lowering `decode`
    int_dot: int_dot.Isa | None = None  # the CPU's integer dot-product variant (None: float kernels)
    activation_bits: int = 16  # the integer-dot kernels' activation quantization (int_dot.py)

    def dim(self, dim: int | str) -> Any:
        if isinstance(dim, int):
            return dim
        if dim not in self.dims:
            self.dims[dim] = tirx.Var(dim, "int64")
        return self.dims[dim]

    def sinfo(self, tensor_type: TensorType) -> relax.TensorType:
        return relax.TensorType([self.dim(d) for d in tensor_type.shape], _DTYPES[tensor_type.dtype])

    def param(
        self,
        value: Value,
        transform: str = "none",
        shape: tuple[int, ...] | None = None,
        dtype_name: str | None = None,
    ) -> relax.Var:
        key = (value.name, transform)
        if key not in self.params:
            given = tuple(int(d) for d in value.type.shape)  # params have fixed shapes
            layout_shape = shape if shape is not None else given
            dtype = _DTYPES[dtype_name or value.type.dtype]
            name = f"w{len(self.param_specs)}"
            self.params[key] = relax.Var(name, relax.TensorType(list(layout_shape), dtype))
            self.param_specs.append(ParamSpec(name, value.name, transform, layout_shape, dtype))
        return self.params[key]

    def value(self, value: Value | None) -> relax.Expr:
        assert value is not None
        if value.kind.value == "param":
            return self.param(value)
        return self.values[value.name]

    def kernel(
        self, kind: str, key: tuple[Any, ...], make: KernelBuilder, info: dict[str, Any]
    ) -> relax.GlobalVar:
        full_key = (kind, *key)
        if self.decode_kernels is not None:
            decode_key = ("decode", *full_key)
            if decode_key not in self.kernels:
                found = self.decode_kernels(kind, key, make(), info)
                self.kernels[decode_key] = self._add_kernel(f"{kind}_decode", *found) if found else None
            if self.kernels[decode_key] is not None:
                return self.kernels[decode_key]
        if full_key not in self.kernels:
            self.kernels[full_key] = self._add_kernel(kind, *self.schedule(kind, make(), info))
        return self.kernels[full_key]

    def _add_kernel(self, prefix: str, func: tirx.PrimFunc, origin: str) -> relax.GlobalVar:
        name = f"{prefix}_{len(self.kernel_origins)}"
        func = func.with_attr("global_symbol", name).with_attr("op_pattern", 8)  # opaque: never refused
        self.kernel_origins[name] = origin
        return self.builder.add_func(func, name)

    def emit(self, expr: relax.Expr) -> relax.Var:
        return self.builder.emit(expr)


Lowering = Callable[[Lowerer, Node], list[relax.Expr]]
LOWERINGS: dict[str, Lowering] = {}


def lowering(op: str) -> Callable[[Lowering], Lowering]:
    def register(function: Lowering) -> Lowering:
        LOWERINGS[op] = function
        return function

    return register


def _out_sinfo(lw: Lowerer, node: Node, index: int = 0) -> relax.TensorType:
    return lw.sinfo(node.outputs[index].type)


ROW_COUNTS = "row_counts"  # int64[2]: the real token rows and logits rows (the rest is padding)


def row_blocks(lw: Lowerer, node: Node) -> Any:
    """The blocks of 4 rows of the node's first input, whose row count must be a padded one (T or L)."""
    leading = node.inputs[0].type.shape[:-1] if node.inputs[0] is not None else ()
    if len(leading) != 1 or leading[0] not in ("T", "L"):
        raise BackendError(
            f"tvm: {node.op} lowers rows of a token- or logits-indexed tensor only, got "
            f"{node.inputs[0].type.text() if node.inputs[0] else '?'}: {node.describe()}"
        )
    return lw.dims["tq" if leading[0] == "T" else "lq"]


def rows_of(lw: Lowerer, node: Node, x: relax.Expr, last: int) -> tuple[relax.Expr, Any]:
    """x[..., last] viewed as [q, 4, last] (`row_blocks`)."""
    blocks = row_blocks(lw, node)
    return lw.emit(relax.op.reshape(x, [blocks, ROW_BLOCK, last])), blocks


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
    y3 = lw.emit(relax.call_tir(kernel, args, relax.TensorType([blocks, ROW_BLOCK, n], _DTYPES[dtype])))
    return [lw.emit(relax.op.reshape(y3, [blocks * ROW_BLOCK, n]))]


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
    scale_block = node.attrs.get("scale_block")
    per = int(scale_block) // int(group) if scale_block and dot_tile is not None else 0
    per = per if per > 1 and (k // group) % per == 0 else 0  # the int-dot kernel's factored scales
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


def factored_scales(lw: Lowerer, scales: Value, tile: int, per: int) -> list[relax.Expr]:
    """Scales (or mins) as [int8 a group, float32 a run of `per` groups] (layouts.py `factored_*`)."""
    n, groups = math.prod(int(d) for d in scales.type.shape[:-1]), int(scales.type.shape[-1])
    sub = lw.param(scales, factored_transform("sub", tile, per), (n // tile, groups, tile), "i8")
    above = lw.param(scales, factored_transform("super", tile, per), (n // tile, groups // per, tile), "f32")
    return [sub, above]


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
    outs = [_out_sinfo(lw, node, i) for i in range(len(node.outputs))]
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


def _rope_call(
    lw: Lowerer, x: relax.Expr, x_type: TensorType, positions: relax.Expr, attrs: dict
) -> relax.Expr:
    heads, head_dim = int(x_type.shape[1]), int(x_type.shape[2])
    inv_freq = rope_inv_freq(head_dim, **attrs).numpy()
    table = rowwise.rope_tables(head_dim, inv_freq)
    scale = float(attrs.get("attention_factor", 1.0))
    kernel = lw.kernel(
        "rope",
        (heads, head_dim, x_type.dtype, scale),
        lambda: rowwise.rope_kernel(heads, head_dim, x_type.dtype, scale),
        {},
    )
    return lw.emit(relax.call_tir(kernel, [x, positions, relax.const(table)], lw.sinfo(x_type)))


@lowering("rope")
def _rope(lw: Lowerer, node: Node) -> list[relax.Expr]:
    x_value, positions = node.inputs
    assert x_value is not None
    return [_rope_call(lw, lw.value(x_value), x_value.type, lw.value(positions), dict(node.attrs))]


@lowering("paged_attention")
def _paged_attention(lw: Lowerer, node: Node) -> list[relax.Expr]:
    q_value, k_value, v_value = node.inputs[:3]
    assert q_value is not None and k_value is not None and v_value is not None
    q, k, v = (lw.value(x) for x in (q_value, k_value, v_value))
    cache, slots, tables, lens, starts = (lw.value(x) for x in node.inputs[3:8])
    rope = node.attrs.get("rope")
    if rope is not None:
        positions = lw.value(node.inputs[8])
        q = _rope_call(lw, q, q_value.type, positions, dict(rope))
        k = _rope_call(lw, k, k_value.type, positions, dict(rope))
    heads, head_dim = int(q_value.type.shape[1]), int(q_value.type.shape[2])
    kv_heads = int(k_value.type.shape[1])
    cache_type = node.inputs[3].type if node.inputs[3] is not None else None
    assert cache_type is not None
    dtype = _DTYPES[q_value.type.dtype]
    cache_dtype = _DTYPES[cache_type.dtype]
    if cache_dtype not in (dtype, FP8):
        raise BackendError(f"tvm: paged_attention needs the cache in q's dtype or float8: {node.describe()}")
    layer = relax.prim_value(tirx.IntImm("int64", int(node.attrs["layer"])))
    key_scale, value_scale = (
        relax.prim_value(tirx.FloatImm("float32", float(s))) for s in node.attrs.get("kv_scale", (1.0, 1.0))
    )
    kernels = attention_cuda_kernels if lw.target_kind == "cuda" else attention_kernels
    write = lw.kernel(
        "kv_write",
        (kv_heads, head_dim, dtype, cache_dtype),
        lambda: kernels.kv_write_kernel(kv_heads, head_dim, dtype, cache_dtype),
        {},
    )
    cache = lw.emit(
        relax.op.call_tir_inplace(
            write, [k, v, cache, slots, layer, key_scale, value_scale], [2], [lw.sinfo(cache_type)]
        )
    )
    lw.values[KV_CACHE_INPUT] = cache  # later layers read the cache after this layer's write
    scale, window = float(node.attrs["scale"]), node.attrs.get("sliding_window")
    attend = lw.kernel(
        "attention",
        (heads, kv_heads, head_dim, scale, window, dtype, cache_dtype),
        lambda: kernels.attention_kernel(heads, kv_heads, head_dim, scale, window, dtype, cache_dtype),
        {},
    )
    out = relax.call_tir(
        attend, [q, cache, tables, lens, starts, layer, key_scale, value_scale], _out_sinfo(lw, node)
    )
    return [lw.emit(out)]


@lowering("embedding")
def _embedding(lw: Lowerer, node: Node) -> list[relax.Expr]:
    return [lw.emit(relax.op.take(lw.value(node.inputs[0]), lw.value(node.inputs[1]), axis=0, mode="clip"))]


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
    dtype = _DTYPES[node.outputs[0].type.dtype]
    factor = relax.const(float(node.attrs["factor"]), dtype)
    return [lw.emit(relax.op.multiply(lw.value(node.inputs[0]), factor))]


@lowering("softcap")
def _softcap(lw: Lowerer, node: Node) -> list[relax.Expr]:
    dtype = _DTYPES[node.outputs[0].type.dtype]
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
    return [swiglu_call(lw, args, _out_sinfo(lw, node), out_type.dtype)]


@lowering("split")
def _split(lw: Lowerer, node: Node) -> list[relax.Expr]:
    sizes = [int(s) for s in node.attrs["sizes"]]
    cuts = list(np.cumsum(sizes)[:-1].tolist())
    pieces = lw.emit(relax.op.split(lw.value(node.inputs[0]), cuts, axis=-1))
    return [lw.emit(relax.TupleGetItem(pieces, i)) for i in range(len(sizes))]


@lowering("cast")
def _cast(lw: Lowerer, node: Node) -> list[relax.Expr]:
    return [lw.emit(relax.op.astype(lw.value(node.inputs[0]), _DTYPES[str(node.attrs["dtype"])]))]


@lowering("transpose")
def _transpose(lw: Lowerer, node: Node) -> list[relax.Expr]:
    return [lw.emit(relax.op.permute_dims(lw.value(node.inputs[0]), [int(p) for p in node.attrs["perm"]]))]


@lowering("all_reduce")
def _all_reduce(lw: Lowerer, node: Node) -> list[relax.Expr]:
    world = relax.prim_value(int(node.attrs["world"]))  # type: ignore[arg-type]
    x = lw.value(node.inputs[0])
    return [lw.emit(relax.call_dps_packed("kiln.all_reduce", [x, world], _out_sinfo(lw, node)))]


@lowering("all_gather")
def _all_gather(lw: Lowerer, node: Node) -> list[relax.Expr]:
    world = relax.prim_value(int(node.attrs["world"]))  # type: ignore[arg-type]
    dim = relax.prim_value(int(node.attrs["dim"]))  # type: ignore[arg-type]
    x = lw.value(node.inputs[0])
    return [lw.emit(relax.call_dps_packed("kiln.all_gather", [x, world, dim], _out_sinfo(lw, node)))]


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
    dtype = _DTYPES[node.outputs[0].type.dtype]
    mask = lw.emit(relax.op.astype(relax.op.expand_dims(inside, -1), dtype))
    return [lw.emit(relax.op.multiply(looked_up, mask))]


def unsupported_nodes(graph: Graph) -> list[str]:
    """Why each node without a lowering cannot be lowered (the capability check)."""
    return [
        f"op {node.op} has no TVM lowering: {node.describe()}"
        for node in graph.nodes
        if node.op not in LOWERINGS
    ]


@dataclass
class LoweredStep:
    module: Any  # tvm.IRModule with the Relax functions (`step`, and `decode` if asked) and their kernels
    params: list[ParamSpec]
    kernel_origins: dict[str, str]
    functions: list[str]


def _lower_function(lw: Lowerer, name: str, blocks: int | None) -> None:
    """Emit one Relax function of the graph: `blocks` token (and logits) row blocks, None: symbolic."""
    lw.dims["tq"] = tirx.Var("tq", "int64") if blocks is None else blocks
    lw.dims["lq"] = tirx.Var("lq", "int64") if blocks is None else blocks
    lw.dims["T"] = lw.dims["tq"] * ROW_BLOCK
    lw.dims["L"] = lw.dims["lq"] * ROW_BLOCK
    graph = lw.graph
    inputs: list[relax.Var] = []
    for value in graph.inputs:
        if value.name in PADDED_INPUTS:
            row_blocks = lw.dims["lq" if value.name == "logits_indices" else "tq"]
            var = relax.Var(value.name, relax.TensorType([row_blocks, ROW_BLOCK], "int64"))
        else:
            expected = STEP_INPUT_TYPES.get(value.name, value.type)
            var = relax.Var(value.name, lw.sinfo(expected if value.name != KV_CACHE_INPUT else value.type))
        inputs.append(var)
    row_counts = relax.Var(ROW_COUNTS, relax.TensorType([2], "int64"))
    with lw.builder.function(name):
        with lw.builder.dataflow():
            for value, var in zip(graph.inputs, inputs, strict=True):
                if value.name in PADDED_INPUTS:
                    flat = [lw.dims["L" if value.name == "logits_indices" else "T"]]
                    lw.values[value.name] = lw.emit(relax.op.reshape(var, flat))
                else:
                    lw.values[value.name] = var
            lw.values[ROW_COUNTS] = row_counts
            for node in graph.nodes:
                try:
                    results = LOWERINGS[node.op](lw, node)
                except BackendError:
                    raise
                except Exception as error:  # a TVM error while lowering: name the node
                    raise BackendError(f"tvm: cannot lower {node.describe()}: {error}") from None
                for out, result in zip(node.outputs, results, strict=True):
                    lw.values[out.name] = result
            (output,) = graph.outputs
            result = lw.builder.emit_output(lw.values[output.name])
        params = [lw.params[(spec.source, spec.transform)] for spec in lw.param_specs]
        lw.builder.emit_func_output(result, params=[*inputs, row_counts, *params])


def lower_graph(
    graph: Graph,
    target_kind: str,
    schedule: Schedule,
    decode: bool = False,
    decode_kernels: DecodeKernels | None = None,
    int_dot_isa: int_dot.Isa | None = None,
    activation_bits: int = 16,
) -> LoweredStep:
    """`step` (symbolic row blocks); with `decode`, also `decode` (one block of token and logits rows),
    which uses `decode_kernels`' kernel where it gives one and the generic kernel otherwise."""
    problems = unsupported_nodes(graph)
    if problems:
        raise BackendError(
            problems[0], hint="`--backend reference` runs every op; or add a TVM lowering for this one"
        )
    lw = Lowerer(graph, target_kind, schedule, int_dot=int_dot_isa, activation_bits=activation_bits)
    _lower_function(lw, "step", None)
    functions = ["step"]
    if decode:
        # fresh Relax vars and dims (a var may not be shared by two functions), shared kernels
        decode_lw = Lowerer(
            graph,
            target_kind,
            schedule,
            builder=lw.builder,
            kernels=lw.kernels,
            kernel_origins=lw.kernel_origins,
            decode_kernels=decode_kernels,
            int_dot=int_dot_isa,
            activation_bits=activation_bits,
        )
        _lower_function(decode_lw, "decode", DECODE_BLOCKS)
        if decode_lw.param_specs != lw.param_specs:
            raise BackendError("tvm: `decode` and `step` lowered to different weight parameters")
        functions.append("decode")
    return LoweredStep(lw.builder.get(), lw.param_specs, lw.kernel_origins, functions)


from kiln.backends.tvm import moe_lowering  # noqa: E402, F401  (registers the moe lowerings)
