"""The step contract: what a compiled model's one function takes (see DESIGN.md), and how per-sequence
slices of work become its flat tensors (`build_step_inputs`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import numpy.typing as npt

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
IndexArray = npt.NDArray[np.int64]
Logits = npt.NDArray[np.float32]  # [rows, vocab] on the host: what a step returns, what the sampler reads


def kv_cache_type(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str = "f32") -> TensorType:
    """[layers, 2 (key, value), num_blocks, block_size, kv_heads, head_dim]."""
    return TensorType(dtype, (num_layers, 2, "NB", "BS", num_kv_heads, head_dim))


@dataclass(frozen=True)
class StepInputs:
    """One step's ragged batch: host int64 arrays; an executable moves them where it computes."""

    token_ids: IndexArray
    positions: IndexArray
    slot_mapping: IndexArray
    block_tables: IndexArray
    seq_lens: IndexArray
    query_start_loc: IndexArray
    logits_indices: IndexArray

    def as_dict(self) -> dict[str, IndexArray]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class SequenceSlice:
    """The tokens one sequence computes in a step, after `num_cached` tokens already in its blocks.

    `logits_at` lists which of these tokens yield a logits row (offsets into `token_ids`, -1 = last);
    empty for a chunk of a prefill that is not finished yet.
    """

    token_ids: Sequence[int]
    num_cached: int
    block_table: Sequence[int]
    logits_at: Sequence[int] = (-1,)


def build_step_inputs(slices: Sequence[SequenceSlice], block_size: int) -> StepInputs:
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    query_start_loc = [0]
    logits_indices: list[int] = []
    for piece in slices:
        seq_len = piece.num_cached + len(piece.token_ids)
        if len(piece.block_table) * block_size < seq_len:
            raise ValueError(f"block table of {len(piece.block_table)} blocks cannot hold {seq_len} tokens")
        if not piece.token_ids:
            raise ValueError("a sequence slice must compute at least one token")
        for offset, token in enumerate(piece.token_ids):
            position = piece.num_cached + offset
            token_ids.append(token)
            positions.append(position)
            slots.append(piece.block_table[position // block_size] * block_size + position % block_size)
        logits_indices += [query_start_loc[-1] + (i % len(piece.token_ids)) for i in piece.logits_at]
        seq_lens.append(seq_len)
        query_start_loc.append(len(token_ids))
    width = max(len(p.block_table) for p in slices)
    tables = [list(p.block_table) + [0] * (width - len(p.block_table)) for p in slices]

    def tensor(values: Sequence[int] | Sequence[Sequence[int]]) -> IndexArray:
        return np.array(values, dtype=np.int64)

    return StepInputs(
        token_ids=tensor(token_ids),
        positions=tensor(positions),
        slot_mapping=tensor(slots),
        block_tables=tensor(tables),
        seq_lens=tensor(seq_lens),
        query_start_loc=tensor(query_start_loc),
        logits_indices=tensor(logits_indices),
    )
