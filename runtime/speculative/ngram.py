"""The n-gram (prompt lookup) proposer: drafts copied from where the sequence's last tokens occurred
before, in its own prompt and output."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from kiln.runtime.scheduler import ScheduledChunk
from kiln.runtime.sequence import Sequence as EngineSequence
from kiln.runtime.speculative.config import SpeculativeConfig


def propose_ngram(tokens: list[int], config: SpeculativeConfig, limit: int) -> list[int]:
    """Up to `limit` tokens that followed the latest earlier match of the longest suffix n-gram."""
    if limit < 1:
        return []
    for n in range(min(config.prompt_lookup_max, len(tokens) - 1), config.prompt_lookup_min - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + min(limit, config.num_speculative_tokens)]
                if follow:
                    return follow
    return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, seq: EngineSequence, limit: int) -> list[int]:
        return propose_ngram(seq.all_token_ids, self.config, limit)

    def scheduled(
        self,
        chunks: Sequence[ScheduledChunk],
        block_table: Callable[[str], list[int]],
        running: Collection[EngineSequence],
    ) -> None:
        """The drafts are final once proposed."""
