"""Speculative decoding: the config, the n-gram (prompt lookup) proposer, and how the verifier works.

Before a step, each decode sequence may get up to `num_speculative_tokens` draft tokens. `ngram`: the
tokens that followed the latest earlier occurrence of its last n tokens (n from `prompt_lookup_max`
down to `prompt_lookup_min`) in its own prompt and output. `draft_model`: a smaller model's tokens
(draft_model.py), its argmax for greedy requests and drawn from its softmax at the request's
temperature for sampled ones.

The step computes the last real token and the drafts as one chunk (their logits rows in one pass over
the weights); the verifier then samples each row in order and goes on while the token equals the next
draft. Greedy rows take the argmax, so a sequence's tokens are those it would have made one at a time
(the kernels are batch-invariant: a row's logits do not depend on how many rows come with it). Sampled
rows keep a draft drawn from q with probability min(1, p(draft) / q(draft)) and otherwise draw from
norm(max(p - q, 0)) (the exact rejection rule; an n-gram's q is one-hot), so each token is distributed
as without speculation. A rejected draft's cache slot is overwritten later. A constrained row is masked
by its matcher as it stands after the tokens before it (the matcher only ever takes verified tokens, so
it never rolls back).
"""

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
