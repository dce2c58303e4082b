"""A Gemma 3 checkpoint with images (`Gemma3ForConditionalGeneration`) read as its parts: the Gemma 3
language model, with image rows in its step whose images attend within themselves both ways, and the
image encoder (`models/gemma3_vision.py`, `vision.py`: SigLIP, average pool, norm, projection)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.frontend.vision import (
    VisionSource,
    gemma3_vision,
    image_token_text,
    language_model_config,
    language_model_weights,
    read_preprocessor,
)
from kiln.ir.deferred import Weight

ARCHITECTURE = "Gemma3ForConditionalGeneration"
_VISION_PREFIXES = (
    "model.vision_tower.",
    "vision_tower.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
)


def text_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The language model's config.json, as if saved on its own."""
    return language_model_config(
        config, where, "Gemma 3", {"gemma3_text": "Gemma3ForCausalLM"}, "gemma3_text"
    )


def text_weights(weights: dict[str, Weight]) -> dict[str, Weight]:
    """The language model's tensors under a causal LM's names; the encoder's are left out."""
    return language_model_weights(weights, _VISION_PREFIXES)


def vision(
    path: Path, config: dict[str, Any], weights: dict[str, Weight], tokenizer_json: str
) -> VisionSource:
    """The checkpoint's image encoder; the image, start and end tokens named as the tokenizer spells
    them."""
    tokens = {
        key: image_token_text(tokenizer_json, config.get(key), path)
        for key in ("image_token_index", "boi_token_index", "eoi_token_index")
    }
    encoder = {name: tensor for name, tensor in weights.items() if name.startswith(_VISION_PREFIXES)}
    return gemma3_vision(
        config,
        encoder,
        read_preprocessor(path),
        (tokens["image_token_index"], int(config["image_token_index"])),
        (tokens["boi_token_index"], int(config["boi_token_index"])),
        tokens["eoi_token_index"],
    )
