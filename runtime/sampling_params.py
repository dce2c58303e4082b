"""What a request asks of generation, validated up front (vLLM's field names and meanings)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
STRUCTURED_KINDS = {  # kind → what its spec holds
    "json": "a JSON schema (JSON text)",
    "json_object": "nothing: any JSON object",
    "regex": "a regular expression",
    "choice": "a JSON list of the allowed strings",
    "grammar": "an EBNF (GBNF) grammar",
}


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


GREEDY_BELOW = 1e-5  # a temperature below this samples greedily
MIN_REPETITION_PENALTY = 1e-5  # below it, dividing float32 logits by the penalty overflows


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text (vLLM's structured outputs): its `kind` (STRUCTURED_KINDS)
    and `spec`, as text so that equal constraints compile once."""

    kind: str
    spec: str | None = None

    def __post_init__(self) -> None:
        _check(
            self.kind in STRUCTURED_KINDS,
            "structured output kind",
            f"one of {list(STRUCTURED_KINDS)}",
            self.kind,
        )
        if self.kind == "json_object":
            return
        _check(
            isinstance(self.spec, str) and bool(self.spec),
            f"the {self.kind} constraint",
            "non-empty",
            self.spec,
        )
        if self.kind in ("json", "choice"):
            try:
                value = json.loads(self.spec or "")
            except json.JSONDecodeError as error:
                raise ValueError(f"the {self.kind} constraint is not valid JSON: {error}") from None
            if self.kind == "json":
                _check(isinstance(value, dict | bool), "a JSON schema", "an object", value)
            else:
                _check(
                    isinstance(value, list) and bool(value) and all(isinstance(c, str) for c in value),
                    "choice",
                    "a non-empty list of strings",
                    value,
                )

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutput:
        return cls("choice", json.dumps(options))

    def describe(self) -> str:
        return {
            "json": "the JSON schema",
            "json_object": "the JSON object grammar",
            "regex": "the regex",
            "choice": "the choice",
            "grammar": "the grammar",
        }[self.kind]


@dataclass(frozen=True)
class ReasoningTokens:
    """A reply's reasoning block by token id (`<think>` … `</think>`): a structured output constrains the
    reply outside it. At the first generated token the prompt's last marker decides where the reply
    stands: after `end`, outside; after `start`, inside; with neither, inside if `implicit_start` (a
    deepseek_r1 reply is reasoning until `end`), else the first token may be `start` (a qwen3 reply
    opens its thinking itself, or does not think)."""

    start: int
    end: int
    implicit_start: bool = False


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
    structured_output: StructuredOutput | None = None
    reasoning: ReasoningTokens | None = None  # a structured output constrains the reply outside them

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
        _check(
            MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2,
            "repetition_penalty",
            f"in [{MIN_REPETITION_PENALTY}, 2]",
            self.repetition_penalty,
        )
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
        """Temperature 0, or one so small that dividing float32 logits by it overflows (vLLM's cut)."""
        return self.temperature < GREEDY_BELOW
