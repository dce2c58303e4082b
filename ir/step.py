"""The step contract: what a compiled model's one function takes (see DESIGN.md)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from kiln.ir.types import TensorType

# T: tokens in the step (all sequences flattened); B: sequences; B1: B + 1; MB: max blocks per sequence;
# L: logits rows wanted (usually one per sampling sequence; more for prompt logprobs, none for a step
# that only continues chunked prefills).
STEP_INPUT_TYPES: dict[str, TensorType] = {
    "token_ids": TensorType("i64", ("T",)),
    "positions": TensorType("i64", ("T",)),
    "slot_mapping": TensorType("i64", ("T",)),
    "block_tables": TensorType("i64", ("B", "MB")),
    "seq_lens": TensorType("i64", ("B",)),
    "query_start_loc": TensorType("i64", ("B1",)),
    "logits_indices": TensorType("i64", ("L",)),
}
KV_CACHE_INPUT = "kv_cache"


def kv_cache_type(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str = "f32") -> TensorType:
    """[layers, 2 (key, value), num_blocks, block_size, kv_heads, head_dim]."""
    return TensorType(dtype, (num_layers, 2, "NB", "BS", num_kv_heads, head_dim))


@dataclass(frozen=True)
class StepInputs:
    """One step's ragged batch; every tensor int64 on the executable's device."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
