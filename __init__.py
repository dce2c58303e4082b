"""Kiln: compile an LLM ahead of time into an artifact per target, serve it from a small runtime."""

from __future__ import annotations

from typing import Any

from kiln.version import __version__

__all__ = [
    "LLM",
    "LoRARequest",
    "ReasoningTokens",
    "SamplingParams",
    "StructuredOutput",
    "WeightSync",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # Lazy, so `import kiln.ir` does not load the whole stack.
    if name == "LLM":
        from kiln.llm import LLM

        return LLM
    if name == "LoRARequest":
        from kiln.runtime.lora import LoRARequest

        return LoRARequest
    if name == "WeightSync":
        from kiln.weight_sync import WeightSync

        return WeightSync
    if name in ("SamplingParams", "StructuredOutput", "ReasoningTokens"):
        from kiln.runtime import sampling_params

        return getattr(sampling_params, name)
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
