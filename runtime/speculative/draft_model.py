"""The draft-model proposer: a second, smaller model with the same vocabulary drafts each speculating
sequence's next tokens, one draft step a token, all sequences batched.

The draft's KV cache has the model's blocks (same count and size) and is addressed through the model's
block tables, so it needs no allocator of its own: whatever blocks the scheduler gives a sequence
(drafts included) hold its draft K/V too. The draft computes every token the model computes, in the
same step: a prefill chunk or a plain decode is mirrored, so blocks the prefix cache serves hold draft
K/V as well (except a sequence's last few tokens, computed by the model after its last draft step; a
draft that reads such a hole drafts worse, never wrongly, since the verifier is exact). A sequence's
draft K/V is valid for its first `computed` tokens; the first draft step of a round computes from there
up to the last real token, each later one the previous draft token. After verification the valid prefix
is what the draft computed and the model accepted; a preemption starts it again from the prefix the
cache serves.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kiln.backends.base import Executable, allocate_kv_cache
from kiln.ir.step import SequenceSlice, build_step_inputs
from kiln.runtime.sampler import apply_distribution_filters, draw, make_generator, softmax
from kiln.runtime.scheduler import ScheduledChunk
from kiln.runtime.sequence import Sequence as EngineSequence

DRAFT_STREAM = 1  # the draft's draws: a stream of the request's seed apart from the sampler's


@dataclass
class _DraftState:
    computed: int  # leading tokens with the draft's K/V in the cache
    preemptions: int  # the sequence's num_preemptions when `computed` was set
    generator: np.random.Generator | None  # sampled requests' draws; None for greedy ones


class DraftModelProposer:
    """Drafts from a second executable; its `propose` leaves placeholders that `scheduled` fills."""

    def __init__(self, executable: Executable, num_blocks: int, block_size: int, vocab_size: int) -> None:
        self.executable = executable
        self.block_size = block_size
        self.vocab_size = vocab_size  # the tokenizer's: draft rows beyond it are padding
        self.kv_cache = allocate_kv_cache(executable, num_blocks, block_size)
        self._states: dict[EngineSequence, _DraftState] = {}  # by identity: a seq_id may be used again

    def propose(self, seq: EngineSequence, limit: int) -> list[int]:
        """Placeholders: the drafts are made once the scheduler has given their blocks."""
        return [0] * max(0, limit)

    def scheduled(
        self,
        chunks: Sequence[ScheduledChunk],
        block_table: Callable[[str], list[int]],
        running: Collection[EngineSequence],
    ) -> None:
        """Mirror the step's `chunks` in the draft's cache and put the drafts (and the q each was drawn
        from) in place of the placeholders of those with drafts; `running`: the sequences still running
        (the others' states are dropped)."""
        still_running = set(running)
        for seq in [s for s in self._states if s not in still_running]:
            del self._states[seq]
        speculating = [(chunk.seq, chunk.num_drafts) for chunk in chunks if chunk.num_drafts]
        tables = {chunk.seq.seq_id: block_table(chunk.seq.seq_id) for chunk in chunks}
        first = []
        for chunk in chunks:
            seq, state = chunk.seq, self._state(chunk.seq, chunk.start)
            end = chunk.start + chunk.num_new_tokens - chunk.num_drafts  # the real tokens' end
            first.append(
                SequenceSlice(seq.all_token_ids[state.computed : end], state.computed, tables[seq.seq_id])
            )
            state.computed = end
        tokens: dict[str, list[int]] = {seq.seq_id: [] for seq, _ in speculating}
        probs: dict[str, list[npt.NDArray[np.float32]]] = {seq.seq_id: [] for seq, _ in speculating}
        logits = self._step(first)
        rows = {chunk.seq: row for row, chunk in enumerate(chunks)}
        for step in range(max((count for _, count in speculating), default=0)):
            active = [seq for seq, count in speculating if count > step]
            if step > 0:
                slices = [
                    SequenceSlice(tokens[seq.seq_id][-1:], seq.num_computed_tokens + step, tables[seq.seq_id])
                    for seq in active
                ]
                logits = self._step(slices)
                rows = {seq: row for row, seq in enumerate(active)}
            for seq in active:
                state = self._states[seq]
                token, q = self._choose(logits[rows[seq]], seq, state)
                tokens[seq.seq_id].append(token)
                if q is not None:
                    probs[seq.seq_id].append(q)
                state.computed = seq.num_computed_tokens + step + 1
        for seq, _ in speculating:
            seq.draft_token_ids = tokens[seq.seq_id]
            seq.draft_probs = np.stack(probs[seq.seq_id]) if probs[seq.seq_id] else None

    def _step(self, slices: list[SequenceSlice]) -> npt.NDArray[np.float32]:
        logits = self.executable.step(build_step_inputs(slices, self.block_size), self.kv_cache)
        return np.asarray(logits, dtype=np.float32)[:, : self.vocab_size]

    def _state(self, seq: EngineSequence, start: int) -> _DraftState:
        """The sequence's draft state; a new one trusts the `start` tokens the scheduler found computed
        (the prefix cache's blocks, which the draft mirrored when the model computed them)."""
        state = self._states.get(seq)
        if state is None or state.preemptions != seq.num_preemptions:
            params = seq.params
            generator = None
            if not params.greedy:
                seed = None if params.seed is None else params.seed + seq.index
                generator = make_generator(seed, stream=DRAFT_STREAM)
            state = self._states[seq] = _DraftState(start, seq.num_preemptions, generator)
        state.computed = min(state.computed, seq.num_computed_tokens)  # what verification kept
        return state

    @staticmethod
    def _choose(
        logits: npt.NDArray[np.float32], seq: EngineSequence, state: _DraftState
    ) -> tuple[int, npt.NDArray[np.float32] | None]:
        if state.generator is None:
            return int(np.argmax(logits)), None
        # the request's own filters: a draft outside its top-k / top-p would always be rejected
        (filtered,) = apply_distribution_filters(logits[None], [seq.params])
        return draw(filtered, state.generator), softmax(filtered)
