"""What the engines hand back for a request, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

# token id → log-probability: the chosen token and the requested number of top alternatives.
TokenLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    """One of a request's n samples. `text`/`token_ids` are cumulative; `delta_*` are new since the last
    output for this request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # None unless the request asks for logprobs (as vLLM)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # first entry None: no logprob for token 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    weight_version: int = 0  # the weights every token of this request came from (runtime/live_weights.py)
    embedding: npt.NDArray[np.float32] | None = None  # an embedding request's vector, once finished
