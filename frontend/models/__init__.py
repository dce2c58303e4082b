"""Model definitions, one per architecture family."""

from __future__ import annotations

from torch import nn

from kiln.frontend.config import ModelConfig, check_architecture
from kiln.frontend.models.llama import LlamaForCausalLM

_FAMILIES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    check_architecture(config.architecture, "model config")
    return _FAMILIES[config.family]
