"""A LLaVA checkpoint (`LlavaForConditionalGeneration`) read as its parts: the language model, which loads
as the family it is (Llama, Mistral, Qwen2) with image rows in its step, and the image encoder
(`models/clip_vision.py`, `vision.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.frontend.vision import (
    VisionSource,
    image_token_text,
    language_model_config,
    language_model_weights,
    llava_vision,
)
from kiln.ir.deferred import Weight

ARCHITECTURE = "LlavaForConditionalGeneration"
TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
_VISION_PREFIXES = (
    "vision_tower.",
    "model.vision_tower.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
)


def text_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The language model's config.json, as if saved on its own."""
    return language_model_config(config, where, "LLaVA", TEXT_ARCHITECTURES, "llama")


def text_weights(weights: dict[str, Weight]) -> dict[str, Weight]:
    """The language model's tensors under a causal LM's names; the encoder's are left out."""
    return language_model_weights(weights, _VISION_PREFIXES)


def vision(
    path: Path, config: dict[str, Any], weights: dict[str, Weight], tokenizer_json: str
) -> VisionSource:
    """The checkpoint's image encoder, its placeholder named as the tokenizer spells it."""
    token = image_token_text(
        tokenizer_json, config.get("image_token_index", config.get("image_token_id")), path
    )
    encoder = {name: tensor for name, tensor in weights.items() if name.startswith(_VISION_PREFIXES)}
    return llava_vision(path, config, encoder, token)
