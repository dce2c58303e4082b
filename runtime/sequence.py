"""A request and its sequences (one per sample when n > 1), with what each has computed and produced."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import numpy.typing as npt

from kiln.runtime.outputs import TokenLogprobs
from kiln.runtime.pooling import Embedding, PooledRows
from kiln.runtime.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sample of a request. Its tokens are the prompt then its output; `num_computed_tokens` of
    them have K/V in the cache. After a preemption it recomputes them all (output included)."""

    seq_id: str
    index: int
    request: Request
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    draft_token_ids: list[int] = field(default_factory=list)  # this step's speculative drafts
    draft_probs: npt.NDArray[np.float32] | None = None  # [drafts, vocab]: what sampled drafts were drawn from

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def cache_key_ids(self) -> list[int]:
        """Its tokens as the prefix cache hashes them: an image's tokens stand for its digest."""
        images = self.request.images
        if images is None:
            return self.all_token_ids
        return images.cache_key_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(frozen=True)
class PromptImages:
    """A prompt's images, encoded once when the request is added (a preempted request keeps them):
    `rows` [E, hidden] in prompt order, placed at prompt positions `positions` [E]."""

    rows: npt.NDArray[np.float32]
    positions: npt.NDArray[np.int64]
    cache_key_ids: list[int]  # the prompt's ids, an image's tokens standing for its digest
    # [start, end) of each image whose tokens attend both ways: a step computes one whole or none of it
    whole_spans: tuple[tuple[int, int], ...] = ()

    def chunk_end(self, start: int, end: int) -> int:
        """Where a chunk of prompt positions [start, end) may end: before an image it would cut, or
        after it where the chunk starts inside it (a step then computes more than asked)."""
        for span_start, span_end in self.whole_spans:
            if span_start < end < span_end:
                return span_start if span_start > start else span_end
        return end

    def in_range(self, start: int, end: int) -> tuple[list[int], npt.NDArray[np.float32]]:
        """(offsets from `start`, rows) of the image tokens at prompt positions [start, end)."""
        first, last = np.searchsorted(self.positions, [start, end])
        return (self.positions[first:last] - start).tolist(), self.rows[first:last]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens, or what the context leaves
    arrival_index: int
    priority: int = 0  # under the priority scheduling policy, smaller is served first
    sequences: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    images: PromptImages | None = None
    lora_name: str | None = None  # its LoRA adapter (runtime/lora.py), None for the base model
    cache_salt: str | None = None  # keys its prefix-cache blocks apart from other adapters' (the adapter's)
    pooled: PooledRows | None = None  # an embedding request's pooling (runtime/pooling.py); no sampling
    embedding: Embedding | None = None  # its result, once the prompt has run

    @property
    def finished(self) -> bool:
        return len(self.sequences) == self.params.n and all(s.is_finished for s in self.sequences)
