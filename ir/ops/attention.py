"""Rotary position embedding and attention over the paged KV cache (the step contract's one stateful op)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kiln.ir.ops.registry import OpDef, register, require, required
from kiln.ir.types import FLOAT_DTYPES, TensorType, shape_text

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_inv_freq(
    head_dim: int,
    *,
    theta: float,
    rope_type: str = "default",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
    factors: Sequence[float] | None = None,
    attention_factor: float = 1.0,  # scales cos and sin (rope), not the frequencies
) -> torch.Tensor:
    """Per-pair rotation frequencies, float32, as HF computes them for each rope type."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    if rope_type == "longrope":  # each pair's wavelength stretched by its factor (Phi-3)
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low_freq_wavelen = original_max_position_embeddings / low_freq_factor
        high_freq_wavelen = original_max_position_embeddings / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    *,
    theta: float,
    rope_type: str = "default",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
    factors: Sequence[float] | None = None,
    attention_factor: float = 1.0,
) -> torch.Tensor:
    """Rotate x[T, heads, head_dim] by position, in the "rotate half" (non-interleaved) layout; cos and
    sin scaled by `attention_factor` (longrope)."""
    head_dim = x.shape[-1]
    inv_freq = rope_inv_freq(
        head_dim,
        theta=theta,
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=low_freq_factor,
        high_freq_factor=high_freq_factor,
        original_max_position_embeddings=original_max_position_embeddings,
        factors=factors,
    )
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


_rotate = rope  # paged_attention's `rope` attribute shadows the function's name there


def _infer_rope(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    x, positions = required(inputs[0], "x"), required(inputs[1], "positions")
    require(
        x.rank == 3 and x.dtype in FLOAT_DTYPES, f"rope expects float x[T, heads, head_dim], got {x.text()}"
    )
    require(positions.rank == 1 and positions.shape[0] == x.shape[0], "positions must be [T] matching x")
    require(attrs.get("rope_type", "default") in ROPE_TYPES, f"rope_type must be one of {ROPE_TYPES}")
    head_dim = x.shape[2]
    require(isinstance(head_dim, int) and head_dim % 2 == 0, "head_dim must be a known even number")
    if attrs.get("rope_type") == "longrope":
        factors = attrs.get("factors")
        require(
            isinstance(factors, list) and isinstance(head_dim, int) and len(factors) == head_dim // 2,
            f"longrope needs `factors`: one per pair of head_dim {head_dim}",
        )
    return [TensorType(x.dtype, x.shape)]


register(
    OpDef(
        "rope",
        (2, 2),
        {
            "theta": "rope base",
            "rope_type": "default | linear | llama3 | longrope",
            "factor": "scaling factor (linear, llama3)",
            "low_freq_factor": "llama3",
            "high_freq_factor": "llama3",
            "original_max_position_embeddings": "llama3",
            "factors": "longrope: each frequency pair's divisor (Phi-3's short or long factors)",
            "attention_factor": "longrope: cos and sin scaled by it",
        },
        _infer_rope,
        rope,
        doc="rotary position embedding of x[T, heads, head_dim] at positions[T]",
    )
)


FP8_MAX = 448.0  # the largest finite float8 e4m3 value


def to_cache(values: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """K or V as the cache stores them: float8 e4m3 as values / scale, saturated to +-448 (the float8
    cast has no infinity); other dtypes as a plain cast, the scale unused (it is 1 there)."""
    if cache_dtype == torch.float8_e4m3fn:
        return (values.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)
    return values.to(cache_dtype)


def from_cache(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """Cached K or V as float32: float8 times its scale, other dtypes as they are."""
    if stored.dtype == torch.float8_e4m3fn:
        return stored.to(torch.float32) * scale
    return stored.to(torch.float32)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor | None = None,
    visible_ends: torch.Tensor | None = None,
    *,
    layer: int,
    scale: float,
    sliding_window: int | None = None,
    rope: dict[str, Any] | None = None,
    kv_scale: Sequence[float] = (1.0, 1.0),
) -> torch.Tensor:
    """Write this step's K/V into the cache at `slot_mapping`, then attend over each sequence's blocks.

    A float8 cache stores K / kv_scale[0] and V / kv_scale[1] (per-tensor scales of this layer).

    With `rope` (the rope op's attributes) and `positions`, q and k are rotated first: the fused form
    of rope → paged_attention, so a backend can rotate in the attention kernel's input stage.

    kv_cache is [layers, 2, num_blocks, block_size, kv_heads, head_dim]. Sequence b owns query rows
    query_start_loc[b]:query_start_loc[b+1], which are the last tokens of its seq_lens[b] context;
    a query at position p sees keys at positions <= p (and > p - sliding_window when one is set).
    With `visible_ends` [T] (a model whose images attend within themselves both ways, Gemma 3's), a
    query sees keys at positions < visible_ends[row] instead of <= p: p + 1 for a text token, the end
    of its image for an image token (whose keys are all in this step or the cache by then).
    Slots < 0 are padding and are not written.
    """
    if rope is not None:
        assert positions is not None
        q, k = _rotate(q, positions, **rope), _rotate(k, positions, **rope)
    num_blocks, block_size, kv_heads, head_dim = kv_cache.shape[2:]
    key_cache = kv_cache[layer, 0].view(num_blocks * block_size, kv_heads, head_dim)
    value_cache = kv_cache[layer, 1].view(num_blocks * block_size, kv_heads, head_dim)
    written = slot_mapping >= 0
    key_scale, value_scale = (float(s) for s in kv_scale)
    key_cache[slot_mapping[written]] = to_cache(k[written], kv_cache.dtype, key_scale)
    value_cache[slot_mapping[written]] = to_cache(v[written], kv_cache.dtype, value_scale)

    group = q.shape[1] // kv_heads
    out = torch.zeros_like(q)
    for b in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        context = int(seq_lens[b])
        if end == start:
            continue
        blocks = block_tables[b, : (context + block_size - 1) // block_size].to(torch.int64)
        keys = kv_cache[layer, 0][blocks].reshape(-1, kv_heads, head_dim)[:context]
        values = kv_cache[layer, 1][blocks].reshape(-1, kv_heads, head_dim)[:context]
        keys = from_cache(keys, key_scale).repeat_interleave(group, dim=1)
        values = from_cache(values, value_scale).repeat_interleave(group, dim=1)
        first_position = context - (end - start)
        for row in range(start, end):
            position = first_position + row - start
            last = position if visible_ends is None else int(visible_ends[row]) - 1
            out[row] = _attend_one(q[row], keys, values, position, last, scale, sliding_window)
    return out


def _attend_one(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: int,
    last: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One query row over exactly the keys it may see (from the window's start to `last`), so its
    result never depends on the batch."""
    lowest = 0 if sliding_window is None else max(0, position - sliding_window + 1)
    visible_keys, visible_values = keys[lowest : last + 1], values[lowest : last + 1]
    scores = torch.einsum("hd,khd->hk", query.to(torch.float32), visible_keys) * scale
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hk,khd->hd", probs, visible_values).to(query.dtype)


def _infer_paged_attention(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    q, k, v = (required(inputs[i], name) for i, name in enumerate(("q", "k", "v")))
    cache = required(inputs[3], "kv_cache")
    slot_mapping, block_tables = required(inputs[4], "slot_mapping"), required(inputs[5], "block_tables")
    seq_lens, query_start_loc = required(inputs[6], "seq_lens"), required(inputs[7], "query_start_loc")
    require(q.rank == 3 and k.rank == 3 and v.rank == 3, "q, k, v must be [T, heads, head_dim]")
    require(k.shape == v.shape, f"k {shape_text(k.shape)} and v {shape_text(v.shape)} differ")
    require(q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2], f"q {shape_text(q.shape)} does not fit k")
    require(
        cache.rank == 6 and cache.shape[1] == 2,
        f"kv_cache must be [L, 2, NB, BS, KVH, D], got {cache.text()}",
    )
    require(
        cache.shape[4] == k.shape[1] and cache.shape[5] == k.shape[2],
        f"kv_cache {shape_text(cache.shape)} does not fit k {shape_text(k.shape)}",
    )
    layer = attrs.get("layer")
    num_layers = cache.shape[0]
    require(
        isinstance(layer, int) and 0 <= layer and (not isinstance(num_layers, int) or layer < num_layers),
        f"layer {layer} is outside the cache's {num_layers} layers",
    )
    heads, kv_heads = q.shape[1], k.shape[1]
    require(
        isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads == 0,
        f"query heads {heads} must be a multiple of kv heads {kv_heads}",
    )
    require(slot_mapping.shape == (q.shape[0],), "slot_mapping must be [T]")
    require(
        block_tables.rank == 2 and seq_lens.rank == 1, "block_tables must be [B, max_blocks], seq_lens [B]"
    )
    require(query_start_loc.rank == 1, "query_start_loc must be [B+1]")
    rope_attrs = attrs.get("rope")
    positions = inputs[8] if len(inputs) > 8 else None
    require((rope_attrs is None) == (positions is None), "rope attrs and the positions input go together")
    visible_ends = inputs[9] if len(inputs) > 9 else None
    require(
        visible_ends is None or (visible_ends.shape == (q.shape[0],) and visible_ends.dtype == "i64"),
        "visible_ends must be [T] i64",
    )
    if rope_attrs is not None:
        require(
            isinstance(rope_attrs, dict) and "theta" in rope_attrs, "rope must hold the rope op's attributes"
        )
        require(positions is not None and positions.shape == (q.shape[0],), "positions must be [T]")
    window = attrs.get("sliding_window")
    require(window is None or (isinstance(window, int) and window > 0), "sliding_window must be None or > 0")
    kv_scale = attrs.get("kv_scale", (1.0, 1.0))
    require(
        len(kv_scale) == 2 and all(isinstance(s, float) and s > 0 for s in kv_scale),
        f"kv_scale must be two positive floats (key, value), got {kv_scale!r}",
    )
    require(
        cache.dtype == "f8e4m3" or tuple(kv_scale) == (1.0, 1.0),
        f"kv_scale {kv_scale!r} applies to a float8 cache only, this one is {cache.dtype}",
    )
    return [TensorType(q.dtype, q.shape)]


register(
    OpDef(
        "paged_attention",
        (8, 10),
        {
            "layer": "which layer of kv_cache this op reads and writes",
            "rope": "None, or the rope op's attributes: rotate q and k at `positions` (9th input) first",
            "scale": "softmax scale, usually head_dim ** -0.5",
            "sliding_window": "None, or how many most recent positions a query sees (itself included)",
            "kv_scale": "(key, value) per-tensor scales of a float8 cache: it stores K / key, V / value",
        },
        _infer_paged_attention,
        paged_attention,
        pure=False,
        doc="attention of q[T,H,D] over the paged cache after writing k, v (see the function)",
    )
)


def _infer_attention(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    q, k, v = (required(inputs[i], name) for i, name in enumerate(("q", "k", "v")))
    require(q.rank == 3 and k.rank == 3 and v.rank == 3, "q, k, v must be [T, heads, head_dim]")
    require(q.shape == k.shape == v.shape, f"q {q.text()}, k {k.text()} and v {v.text()} must agree")
    num_rows = inputs[3] if len(inputs) > 3 else None
    if num_rows is not None:
        require(
            num_rows.shape == (1,) and num_rows.dtype == "i64",
            f"num_rows must be [1] i64, got {num_rows.text()}",
        )
    require(isinstance(attrs.get("scale"), float), "scale must be a float")
    return [TensorType(q.dtype, q.shape)]


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_rows: torch.Tensor | None = None, *, scale: float
) -> torch.Tensor:
    """Each row sees the first `num_rows` rows (all without it): one image's patches, the rows past
    them padding, whose own results are zeros. In float32 whatever the dtype."""
    real = q.shape[0] if num_rows is None else int(num_rows[0])
    scores = torch.einsum("qhd,khd->hqk", q[:real].float(), k[:real].float()) * scale
    out = torch.zeros(q.shape, dtype=torch.float32)
    out[:real] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v[:real].float())
    return out.to(q.dtype)


register(
    OpDef(
        "attention",
        (3, 4),
        {"scale": "softmax scale, usually head_dim ** -0.5"},
        _infer_attention,
        attention,
        doc="bidirectional attention of q[T,H,D] over k, v[T,H,D] of one sequence (a vision encoder's), "
        "its first num_rows[0] rows real (optional 4th input)",
    )
)
