"""Model definitions, one per architecture family."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from kiln.frontend.config import ModelConfig, check_architecture
from kiln.frontend.models import gemma3, moe, phi3
from kiln.frontend.models.llama import LlamaForCausalLM

_FAMILIES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma3": gemma3.Gemma3ForCausalLM,
    "phi3": LlamaForCausalLM,
    "mixtral": LlamaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,
    "olmoe": LlamaForCausalLM,
}
# HF checkpoints whose weights differ from the definition's: Gemma's norms store w for 1 + w, Phi-3
# fuses q/k/v and gate/up, mixture-of-experts models store each expert apart
_HF_WEIGHT_ADAPTERS: dict[str, Callable[[ModelConfig, dict[str, Any]], dict[str, Any]]] = {
    "gemma3": gemma3.from_hf_weights,
    "phi3": phi3.split_fused_weights,
    "mixtral": moe.stack_experts,
    "qwen3_moe": moe.stack_experts,
    "olmoe": moe.stack_experts,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The definition of `config`'s family; its step takes the optional inputs the config asks for
    (image rows, visible_ends: frontend/capture.py step_input_types)."""
    check_architecture(config.architecture, "model config")
    return _FAMILIES[config.family]


def adapt_hf_weights(config: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    adapter = _HF_WEIGHT_ADAPTERS.get(config.family)
    return weights if adapter is None else adapter(config, weights)


def adapt_gguf_weights(config: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """GGUF files store Gemma's norms as 1 + w already; only Phi-3's fused weights need splitting."""
    return phi3.split_fused_weights(config, weights) if config.family == "phi3" else weights
