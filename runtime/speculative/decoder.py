"""The engine's side of speculative decoding: drafts before scheduling, the proposer's look at the
scheduled step, and the verifier that keeps each sequence's rows while they agree with its drafts."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kiln.runtime.scheduler import ScheduledChunk
from kiln.runtime.sequence import Sequence as EngineSequence
from kiln.runtime.speculative.config import SpeculativeConfig
from kiln.runtime.speculative.proposer import Proposer

logger = logging.getLogger(__name__)
SPEC_LOG_EVERY = 200  # speculating sequence-steps between acceptance log lines

# Samples a [1, vocab] logits row (one with a draft, given the q it was drawn from, by the rejection rule),
# appends the token to the sequence, and returns it.
SampleRow = Callable[[npt.NDArray[np.float32], int | None, npt.NDArray[np.float32] | None], int]


@dataclass
class SpeculativeStats:
    num_drafts: int = 0  # speculating sequence-steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)  # accepted drafts by position

    def copy(self) -> SpeculativeStats:
        return SpeculativeStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_at)
        )


class SpeculativeDecoder:
    def __init__(
        self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int, stats: SpeculativeStats
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = stats

    def propose(self, running: Collection[EngineSequence]) -> None:
        """Before scheduling: drafts for the running sequences about to decode one token."""
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens != 1:
                continue
            limit = min(
                self.config.num_speculative_tokens,
                seq.request.max_tokens - len(seq.output_token_ids) - 1,
                self.max_model_len - seq.num_tokens - 1,
            )
            seq.draft_token_ids = self.proposer.propose(seq, limit)

    def scheduled(
        self,
        chunks: Sequence[ScheduledChunk],
        block_table: Callable[[str], list[int]],
        running: Collection[EngineSequence],
    ) -> None:
        """After scheduling, before the step: the proposer settles the scheduled drafts."""
        self.proposer.scheduled(chunks, block_table, running)

    def verify(
        self, seq: EngineSequence, rows: npt.NDArray[np.float32], num_drafts: int, sample_row: SampleRow
    ) -> int:
        """Sample `rows` (the last real token's, then each draft's) in order while the token equals the
        next draft; returns how many drafts were accepted."""
        drafts = seq.draft_token_ids[:num_drafts]
        probs = seq.draft_probs
        accepted = 0
        for index in range(num_drafts + 1):
            draft = drafts[index] if index < num_drafts else None
            q = probs[index] if probs is not None and draft is not None else None
            token = sample_row(rows[index : index + 1], draft, q)
            if seq.is_finished or index == num_drafts or token != drafts[index]:
                break
            accepted += 1
        self._count(num_drafts, accepted)
        return accepted

    @staticmethod
    def end_step(chunks: Sequence[ScheduledChunk]) -> None:
        """The step's drafts are spent, accepted or not."""
        for chunk in chunks:
            chunk.seq.draft_token_ids = []
            chunk.seq.draft_probs = None

    def _count(self, num_drafts: int, accepted: int) -> None:
        stats = self.stats
        stats.num_drafts += 1
        if stats.num_drafts % SPEC_LOG_EVERY == 0:
            self._log_acceptance()
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += accepted
        at = stats.accepted_at
        at.extend([0] * (num_drafts - len(at)))
        for position in range(accepted):
            at[position] += 1

    def _log_acceptance(self) -> None:
        stats = self.stats
        logger.info(
            "speculative decoding: %d of %d draft tokens accepted (%.0f%%), %.2f a draft",
            stats.num_accepted_tokens,
            stats.num_draft_tokens,
            100 * stats.num_accepted_tokens / max(1, stats.num_draft_tokens),
            stats.num_accepted_tokens / max(1, stats.num_drafts),
        )
