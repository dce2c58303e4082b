"""Lowerings of rope and paged_attention: RoPE, the KV cache write and attention over the paged cache."""

from __future__ import annotations

from tvm import relax, tirx

from kiln.backends.base import BackendError
from kiln.backends.tvm.kernels import attention as attention_kernels
from kiln.backends.tvm.kernels import attention_cuda as attention_cuda_kernels
from kiln.backends.tvm.kernels import rowwise
from kiln.backends.tvm.kernels.kv_format import FP8
from kiln.backends.tvm.lowerer import TVM_DTYPES, Lowerer, out_sinfo
from kiln.backends.tvm.lowering_registry import lowering
from kiln.ir import KV_CACHE_INPUT, Node, TensorType
from kiln.ir.ops.attention import rope_inv_freq

CACHE_DTYPES = ("float32", "float16", "bfloat16")


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
    dtype = TVM_DTYPES[q_value.type.dtype]
    cache_dtype = TVM_DTYPES[cache_type.dtype]
    if cache_dtype not in (*CACHE_DTYPES, FP8):
        raise BackendError(
            f"tvm: paged_attention stores its cache as float32, float16, bfloat16 or float8, not "
            f"{cache_dtype}: {node.describe()}"
        )
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
    visible_ends = node.inputs[9] if len(node.inputs) > 9 else None
    has_ends = visible_ends is not None
    ends = [lw.value(visible_ends)] if has_ends else []
    attend = lw.kernel(
        "attention",
        (heads, kv_heads, head_dim, scale, window, dtype, cache_dtype, has_ends),
        lambda: kernels.attention_kernel(
            heads, kv_heads, head_dim, scale, window, dtype, cache_dtype, visible_ends=has_ends
        ),
        {},
    )
    out = relax.call_tir(
        attend, [q, cache, tables, lens, starts, *ends, layer, key_scale, value_scale], out_sinfo(lw, node)
    )
    return [lw.emit(out)]
