"""What the engine asks of a proposer, and the proposer a config names."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from kiln.backends.base import Executable
from kiln.runtime.scheduler import ScheduledChunk
from kiln.runtime.sequence import Sequence as EngineSequence
from kiln.runtime.speculative.config import SpeculativeConfig
from kiln.runtime.speculative.draft_model import DraftModelProposer
from kiln.runtime.speculative.ngram import NgramProposer


class Proposer(Protocol):
    def propose(self, seq: EngineSequence, limit: int) -> list[int]:
        """Before scheduling: up to `limit` drafts for `seq`, which is about to decode one token (the
        scheduler makes room for them, or for none). Placeholders where `scheduled` makes them."""
        ...

    def scheduled(
        self,
        chunks: Sequence[ScheduledChunk],
        block_table: Callable[[str], list[int]],
        running: Collection[EngineSequence],
    ) -> None:
        """After scheduling, before the step: settle the drafts of the scheduled `chunks`; `running`:
        the sequences still running."""
        ...


def make_proposer(
    config: SpeculativeConfig, draft: Executable | None, num_blocks: int, block_size: int, vocab_size: int
) -> Proposer:
    """`draft`: the draft model of method draft_model, whose cache mirrors the model's `num_blocks`
    blocks of `block_size`; `vocab_size`: the tokenizer's."""
    if config.method == "ngram":
        return NgramProposer(config)
    assert draft is not None
    return DraftModelProposer(draft, num_blocks, block_size, vocab_size)
