"""Turn per-sequence slices of work into the step contract's flat tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kiln.ir import StepInputs


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

    def tensor(values: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return StepInputs(
        token_ids=tensor(token_ids),
        positions=tensor(positions),
        slot_mapping=tensor(slots),
        block_tables=tensor(tables),
        seq_lens=tensor(seq_lens),
        query_start_loc=tensor(query_start_loc),
        logits_indices=tensor(logits_indices),
    )
