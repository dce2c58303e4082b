"""Elementwise, shape, embedding, linear and normalisation ops."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ir.ops.registry import OpDef, register, require, required
from kiln.ir.types import FLOAT_DTYPES, Dim, Shape, TensorType, numel_factors, shape_text


def _broadcast(a: Shape, b: Shape) -> Shape:
    out: list[Dim] = []
    for i in range(max(len(a), len(b))):
        da = a[len(a) - 1 - i] if i < len(a) else 1
        db = b[len(b) - 1 - i] if i < len(b) else 1
        require(
            da == db or da == 1 or db == 1, f"shapes {shape_text(a)} and {shape_text(b)} do not broadcast"
        )
        out.append(db if da == 1 else da)
    return tuple(reversed(out))


def _infer_binary(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    a, b = required(inputs[0], "lhs"), required(inputs[1], "rhs")
    require(a.dtype == b.dtype, f"dtypes differ: {a.dtype} and {b.dtype}")
    return [TensorType(a.dtype, _broadcast(a.shape, b.shape))]


def _infer_same(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    x = required(inputs[0], "x")
    require(x.dtype in FLOAT_DTYPES, f"expects a float input, got {x.dtype}")
    return [TensorType(x.dtype, x.shape)]


register(OpDef("add", (2, 2), {}, _infer_binary, lambda a, b: a + b, doc="a + b, broadcasting"))
register(OpDef("mul", (2, 2), {}, _infer_binary, lambda a, b: a * b, doc="a * b, broadcasting"))
register(OpDef("silu", (1, 1), {}, _infer_same, lambda x: F.silu(x), doc="x * sigmoid(x)"))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def scale(x: torch.Tensor, *, factor: float) -> torch.Tensor:
    """x times `factor` rounded to x's dtype first (as Gemma scales its embeddings)."""
    return x * torch.tensor(factor, dtype=x.dtype)


def softcap(x: torch.Tensor, *, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


register(
    OpDef("gelu_tanh", (1, 1), {}, _infer_same, gelu_tanh, doc="GELU, tanh approximation (Gemma's GeGLU)")
)
register(OpDef("gelu", (1, 1), {}, _infer_same, lambda x: F.gelu(x), doc="GELU with erf (vision towers)"))
register(
    OpDef(
        "quick_gelu",
        (1, 1),
        {},
        _infer_same,
        lambda x: x * torch.sigmoid(1.702 * x),
        doc="x * sigmoid(1.702 x) (CLIP's activation)",
    )
)
register(OpDef("scale", (1, 1), {"factor": "the constant multiplier"}, _infer_same, scale, doc="x * factor"))
register(
    OpDef(
        "softcap",
        (1, 1),
        {"cap": "the bound: outputs lie in (-cap, cap)"},
        _infer_same,
        softcap,
        doc="tanh(x / cap) * cap (Gemma's final-logit soft-capping)",
    )
)


def resolve_reshape(src: Shape, target: Sequence[Dim]) -> Shape:
    """The reshape of `src` to `target` where one target dim may be -1 (inferred, possibly symbolic)."""
    require(
        sum(1 for d in target if d == -1) <= 1, f"reshape target {shape_text(target)} has more than one -1"
    )
    known = [d for d in target if d != -1]
    if len(known) == len(target):
        src_n, tgt_n = numel_factors(src), numel_factors(tuple(target))
        require(src_n == tgt_n, f"cannot reshape {shape_text(src)} to {shape_text(target)}")
        return tuple(target)
    src_const, src_syms = numel_factors(src)
    tgt_const, tgt_syms = numel_factors(tuple(known))
    rest = list(src_syms)
    for sym in tgt_syms:
        require(
            sym in rest, f"cannot reshape {shape_text(src)} to {shape_text(target)}: {sym} not in the source"
        )
        rest.remove(sym)
    require(
        tgt_const > 0 and src_const % tgt_const == 0,
        f"cannot reshape {shape_text(src)} to {shape_text(target)}: sizes do not divide",
    )
    const = src_const // tgt_const
    if not rest:
        inferred: Dim = const
    else:
        require(
            len(rest) == 1 and const == 1,
            f"cannot infer -1 in {shape_text(target)} from {shape_text(src)} ({const}*{'*'.join(rest)})",
        )
        inferred = rest[0]
    return tuple(inferred if d == -1 else d for d in target)


def _infer_reshape(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    x = required(inputs[0], "x")
    return [TensorType(x.dtype, resolve_reshape(x.shape, attrs["shape"]))]


def _reshape(x: torch.Tensor, *, shape: list[Dim]) -> torch.Tensor:
    concrete = [d if isinstance(d, int) else -1 for d in shape]
    return x.reshape(concrete)


register(
    OpDef(
        "reshape",
        (1, 1),
        {"shape": "target dims; ints, symbols, or one -1 to infer"},
        _infer_reshape,
        _reshape,
        doc="reshape without moving data",
    )
)


def _infer_embedding(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    weight, ids = required(inputs[0], "weight"), required(inputs[1], "ids")
    require(weight.rank == 2, f"embedding weight must be 2-D, got {shape_text(weight.shape)}")
    require(ids.dtype in ("i32", "i64"), f"ids must be integers, got {ids.dtype}")
    return [TensorType(weight.dtype, (*ids.shape, weight.shape[1]))]


register(
    OpDef(
        "embedding",
        (2, 2),
        {},
        _infer_embedding,
        lambda weight, ids: F.embedding(ids, weight),
        doc="rows of weight[V, H] at ids",
    )
)


def _infer_embedding_with_rows(
    inputs: Sequence[TensorType | None], attrs: dict[str, Any]
) -> list[TensorType]:
    (out,) = _infer_embedding(inputs[:2], attrs)
    weight, rows = required(inputs[0], "weight"), required(inputs[2], "rows")
    require(
        rows.rank == 2 and rows.shape[1] == weight.shape[1] and rows.dtype == weight.dtype,
        f"rows {rows.text()} must be [E, {weight.shape[1]}] {weight.dtype}",
    )
    return [out]


def embedding_with_rows(weight: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    vocab = weight.shape[0]
    out = F.embedding(ids.clamp(max=vocab - 1), weight)
    extra = ids >= vocab
    out[extra] = rows[ids[extra] - vocab]
    return out


register(
    OpDef(
        "embedding_with_rows",
        (3, 3),
        {},
        _infer_embedding_with_rows,
        embedding_with_rows,
        doc="rows of weight[V, H] at ids, and rows[id - V] for ids >= V (an image's embeddings)",
    )
)


def _infer_take_rows(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    x, idx = required(inputs[0], "x"), required(inputs[1], "indices")
    require(idx.rank == 1 and idx.dtype in ("i32", "i64"), f"indices must be 1-D ints, got {idx.text()}")
    require(x.rank >= 1, "x must have a leading dim")
    return [TensorType(x.dtype, (idx.shape[0], *x.shape[1:]))]


register(
    OpDef(
        "take_rows",
        (2, 2),
        {},
        _infer_take_rows,
        lambda x, indices: torch.index_select(x, 0, indices),
        doc="x[indices] along dim 0",
    )
)


def _infer_linear(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    x, w = required(inputs[0], "x"), required(inputs[1], "weight")
    require(w.rank == 2, f"linear weight must be 2-D, got {shape_text(w.shape)}")
    require(
        x.rank >= 1 and x.shape[-1] == w.shape[1],
        f"x {shape_text(x.shape)} does not fit weight {shape_text(w.shape)}",
    )
    require(x.dtype == w.dtype, f"x is {x.dtype} but weight is {w.dtype}")
    bias = inputs[2] if len(inputs) > 2 else None
    if bias is not None:
        require(
            bias.shape == (w.shape[0],),
            f"bias {shape_text(bias.shape)} does not fit weight {shape_text(w.shape)}",
        )
    return [TensorType(x.dtype, (*x.shape[:-1], w.shape[0]))]


# BLAS picks kernels (and so summation orders) by the number of rows, so a row's result would depend on
# what else is in the batch. The reference multiplies fixed-size, zero-padded groups of rows instead:
# each row then always goes through the same kernel, and a request's logits do not depend on its batch.
LINEAR_ROW_GROUP = 8


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.dtype != torch.float32:  # f16 / bf16: accumulate in float32
        wide_bias = bias.to(torch.float32) if bias is not None else None
        return linear_rows(x.to(torch.float32), weight.to(torch.float32), wide_bias).to(x.dtype)
    rows = x.reshape(-1, x.shape[-1])
    num_rows = rows.shape[0]
    if num_rows == 0:
        return x.new_zeros((*x.shape[:-1], weight.shape[0]))
    padding = (-num_rows) % LINEAR_ROW_GROUP
    if padding:
        rows = torch.cat((rows, rows.new_zeros(padding, rows.shape[1])))
    out = torch.cat([F.linear(group, weight, bias) for group in rows.split(LINEAR_ROW_GROUP)])
    return out[:num_rows].reshape(*x.shape[:-1], weight.shape[0])


register(OpDef("linear", (2, 3), {}, _infer_linear, linear_rows, doc="x @ weight.T + bias; weight[N, K]"))


def _infer_layer_norm(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    x, weight, bias = required(inputs[0], "x"), required(inputs[1], "weight"), required(inputs[2], "bias")
    require(x.dtype in FLOAT_DTYPES, f"expects a float input, got {x.dtype}")
    for name, param in (("weight", weight), ("bias", bias)):
        require(param.shape == (x.shape[-1],), f"{name} {shape_text(param.shape)} does not fit x {x.text()}")
    return [TensorType(x.dtype, x.shape)]


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, eps: float) -> torch.Tensor:
    """Over the last dim, in float32 whatever x's dtype."""
    wide = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
    return wide.to(x.dtype)


register(
    OpDef(
        "layer_norm",
        (3, 3),
        {"eps": "added to the variance"},
        _infer_layer_norm,
        layer_norm,
        doc="(x - mean) / sqrt(var + eps) * weight + bias over the last dim",
    )
)


def _infer_rms_norm(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    x, w = required(inputs[0], "x"), required(inputs[1], "weight")
    require(
        w.shape == (x.shape[-1],), f"norm weight {shape_text(w.shape)} does not fit x {shape_text(x.shape)}"
    )
    return [TensorType(x.dtype, x.shape)]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """Normalise in float32 and scale, as HF Llama does."""
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


register(
    OpDef(
        "rms_norm",
        (2, 2),
        {"eps": "added to the mean square"},
        _infer_rms_norm,
        rms_norm,
        doc="x / sqrt(mean(x^2) + eps) * weight over the last dim",
    )
)
