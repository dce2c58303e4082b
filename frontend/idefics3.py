"""An Idefics3 / SmolVLM checkpoint (`Idefics3ForConditionalGeneration`) read as its parts: the Llama
language model, with image rows in its step, and the image encoder (`models/idefics3_vision.py`,
`vision.py`: SigLIP over each tile, pixel shuffle, connector)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.frontend.vision import (
    VisionSource,
    idefics3_vision,
    image_token_text,
    language_model_config,
    read_preprocessor,
)
from kiln.ir.deferred import Weight

ARCHITECTURE = "Idefics3ForConditionalGeneration"
_TEXT_PREFIX = ("model.text_model.", "model.")
_VISION_PREFIXES = ("model.vision_model.", "model.connector.")


def text_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The language model's config.json, as if saved on its own."""
    return language_model_config(config, where, "Idefics3", {"llama": "LlamaForCausalLM"}, "llama")


def text_weights(weights: dict[str, Weight]) -> dict[str, Weight]:
    """The language model's tensors under a causal LM's names; the encoder's are left out."""
    old, new = _TEXT_PREFIX
    return {
        (new + name.removeprefix(old) if name.startswith(old) else name): tensor
        for name, tensor in weights.items()
        if not name.startswith(_VISION_PREFIXES)
    }


def vision(
    path: Path, config: dict[str, Any], weights: dict[str, Weight], tokenizer_json: str
) -> VisionSource:
    token_id = config.get("image_token_id")
    token = image_token_text(tokenizer_json, token_id, path)
    encoder = {name: tensor for name, tensor in weights.items() if name.startswith(_VISION_PREFIXES)}
    return idefics3_vision(config, encoder, read_preprocessor(path), token, int(token_id))
