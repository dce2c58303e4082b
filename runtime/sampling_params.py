"""What a request asks of generation, validated up front (vLLM's field names and meanings)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass
class SamplingParams:
    """Sampling and stopping for one request. temperature 0 means greedy.

    top_k None (or 0 / -1, as OpenAI-style clients send) means no top-k; max_tokens None means up to
    the model's context. logprobs / prompt_logprobs: how many top alternatives to return per token
    besides the chosen one (None: none at all).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k is not None and self.top_k in (0, -1):
            self.top_k = None
        _check(isinstance(self.n, int) and self.n >= 1, "n", ">= 1", self.n)
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0, "temperature", ">= 0", self.temperature
        )
        _check(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(
            self.top_k is None or self.top_k >= 1, "top_k", ">= 1, or 0 / -1 / None to disable", self.top_k
        )
        _check(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        _check(0 < self.repetition_penalty <= 2, "repetition_penalty", "in (0, 2]", self.repetition_penalty)
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", ">= 1", self.max_tokens)
        _check(self.min_tokens >= 0, "min_tokens", ">= 0", self.min_tokens)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", "<= max_tokens", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or 0 <= value <= MAX_LOGPROBS, name, f"in [0, {MAX_LOGPROBS}]", value)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings", self.stop)
        for token, bias in (self.logit_bias or {}).items():
            _check(isinstance(token, int) and token >= 0, "logit_bias", "keyed by token ids >= 0", token)
            _check(-100 <= bias <= 100, "logit_bias", "values in [-100, 100]", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
