"""Functions the model definitions call for ops that torch has no single function for.

Each runs eagerly with the IR op's own reference semantics, and capture keeps it as one fx node
(they are the tracer's `autowrap_functions`), which maps to the IR op of the same name. Tensors are
positional; attributes are keyword-only and become the IR node's attributes.
"""

from __future__ import annotations

import torch

from kiln.ir.ops import get_op


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    return get_op("rms_norm").reference(x, weight, eps=eps)


def rope(x: torch.Tensor, positions: torch.Tensor, **attrs: float | int | str) -> torch.Tensor:
    return get_op("rope").reference(x, positions, **attrs)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: None = None,
    visible_ends: torch.Tensor | None = None,
    *,
    layer: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`positions` stays None here (the rope fusion fills it); `visible_ends`: the step's, for a model
    whose images attend both ways (ir/step.py VISIBLE_ENDS_INPUT). Pass them positionally, as the op's
    9th and 10th inputs, only with `visible_ends`."""
    return get_op("paged_attention").reference(
        q,
        k,
        v,
        kv_cache,
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        positions,
        visible_ends,
        layer=layer,
        scale=scale,
        sliding_window=sliding_window,
    )


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return get_op("gelu_tanh").reference(x)


def embedding_with_rows(weight: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return get_op("embedding_with_rows").reference(weight, ids, rows)


def gelu(x: torch.Tensor) -> torch.Tensor:
    return get_op("gelu").reference(x)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return get_op("quick_gelu").reference(x)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, eps: float) -> torch.Tensor:
    return get_op("layer_norm").reference(x, weight, bias, eps=eps)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_rows: torch.Tensor, *, scale: float
) -> torch.Tensor:
    return get_op("attention").reference(q, k, v, num_rows, scale=scale)


def scale(x: torch.Tensor, *, factor: float) -> torch.Tensor:
    return get_op("scale").reference(x, factor=factor)


def softcap(x: torch.Tensor, *, cap: float) -> torch.Tensor:
    return get_op("softcap").reference(x, cap=cap)


def moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    *,
    top_k: int,
    normalize: bool,
) -> torch.Tensor:
    return get_op("moe").reference(x, router_logits, gate, up, down, top_k=top_k, normalize=normalize)


WRAPPED_OPS = {
    rms_norm: "rms_norm",
    rope: "rope",
    paged_attention: "paged_attention",
    gelu_tanh: "gelu_tanh",
    gelu: "gelu",
    embedding_with_rows: "embedding_with_rows",
    quick_gelu: "quick_gelu",
    layer_norm: "layer_norm",
    attention: "attention",
    scale: "scale",
    softcap: "softcap",
    moe: "moe",
}
