"""Phi-3: the Llama definition, with the checkpoint's fused `qkv_proj` and `gate_up_proj` split at load
(HF and GGUF alike: rows are independent, so GGUF blocks split as they are)."""

from __future__ import annotations

from typing import Any

from kiln.frontend.config import ModelConfig
from kiln.frontend.source import QuantizedTensor
from kiln.ir.deferred import Deferred

FUSED = {  # fused weight → the parts, in row order
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def _rows(weight: Any, start: int, stop: int) -> Any:
    if isinstance(weight, QuantizedTensor):
        return weight.rows(start, stop)
    if isinstance(weight, Deferred):
        return weight.then((stop - start, *weight.shape[1:]), weight.dtype, lambda values: values[start:stop])
    return weight[start:stop]


def split_fused_weights(config: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    sizes = {
        "self_attn.qkv_proj": (q_size, kv_size, kv_size),
        "mlp.gate_up_proj": (config.intermediate_size, config.intermediate_size),
    }
    split: dict[str, Any] = {}
    for name, weight in weights.items():
        prefix, _, kind = name.rpartition(".")
        fused = next((f for f in FUSED if prefix.endswith(f)), None)
        if fused is None:
            split[name] = weight
            continue
        start = 0
        for part, size in zip(FUSED[fused], sizes[fused], strict=True):
            split[f"{prefix[: -len(fused)]}{part}.{kind}"] = _rows(weight, start, start + size)
            start += size
    return split
