"""The speculative decoding settings: vLLM's `--speculative-config`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config`: {"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4, "prompt_lookup_min": 1}, or {"model": "qwen2.5-coder-0.5b-instruct",
    "num_speculative_tokens": 4} (method draft_model; `model` is anything `kiln serve` takes)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not supported (supported: {', '.join(METHODS)})"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                'a draft model is named by "model" with method draft_model (or no method); '
                f"method {self.method!r} with model {self.model!r} does not fit"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """From the JSON text of `--speculative-config` or a dict; unknown keys are refused."""
        raw = json.loads(value) if isinstance(value, str) else dict(value)
        if "model" in raw:
            raw.setdefault("method", "draft_model")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known: {sorted(known)}")
        return cls(**raw)
