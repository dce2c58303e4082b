"""Model definitions, one per architecture family."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from kiln.frontend.config import ModelConfig, check_architecture
from kiln.frontend.models import gemma3
from kiln.frontend.models.llama import LlamaForCausalLM

_FAMILIES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma3": gemma3.Gemma3ForCausalLM,
}
# HF checkpoints whose weights differ from the definition's (Gemma's norms store w for 1 + w)
_HF_WEIGHT_ADAPTERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "gemma3": gemma3.from_hf_weights
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    check_architecture(config.architecture, "model config")
    return _FAMILIES[config.family]


def adapt_hf_weights(config: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    adapter = _HF_WEIGHT_ADAPTERS.get(config.family)
    return weights if adapter is None else adapter(weights)
