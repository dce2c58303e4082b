"""The one value a model's step code passes down its layers (as nano-vllm's context): the step's input
tensors by name, fx proxies while capture traces it (frontend/capture.py makes one placeholder an input
of the step's signature). A layer reads what it needs; `attention_inputs` are what `paged_attention`
reads besides q, k and v."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from kiln.ir.step import IMAGE_ROWS_INPUT, KV_CACHE_INPUT, STEP_INPUT_TYPES, VISIBLE_ENDS_INPUT


@dataclass(frozen=True)
class StepTensors:
    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor
    kv_cache: torch.Tensor
    optional: Mapping[str, torch.Tensor] = field(default_factory=dict)  # the model's optional inputs

    @classmethod
    def of(cls, named: Mapping[str, torch.Tensor]) -> StepTensors:
        """The step's tensors from every input by name (the contract's, kv_cache, optional ones)."""
        fixed = (*STEP_INPUT_TYPES, KV_CACHE_INPUT)
        optional = {name: tensor for name, tensor in named.items() if name not in fixed}
        return cls(**{name: named[name] for name in fixed}, optional=optional)

    @property
    def image_rows(self) -> torch.Tensor | None:
        return self.optional.get(IMAGE_ROWS_INPUT)

    @property
    def visible_ends(self) -> torch.Tensor | None:
        return self.optional.get(VISIBLE_ENDS_INPUT)

    def attention_inputs(self) -> tuple[torch.Tensor | None, ...]:
        """paged_attention's inputs after q, k, v: the cache and the batch's layout, then (only for a model
        that takes visible_ends) positions, left None for the rope fusion to fill, and visible_ends."""
        ends = self.visible_ends
        batch = (self.kv_cache, self.slot_mapping, self.block_tables, self.seq_lens, self.query_start_loc)
        return batch if ends is None else (*batch, None, ends)
