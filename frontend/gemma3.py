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
    read_preprocessor,
)
from kiln.ir.deferred import Weight

ARCHITECTURE = "Gemma3ForConditionalGeneration"
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
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
    """The language model's tensors under a causal LM's names (`model.layers.0...`, `lm_head`); the
    encoder's are left out."""
    text: dict[str, Weight] = {}
    for name, tensor in weights.items():
        if name.startswith(_VISION_PREFIXES):
            continue
        renamed = name.removeprefix("language_model.") if name.startswith("language_model.lm_head.") else name
        for prefix in _TEXT_PREFIXES:
            if name.startswith(prefix):
                renamed = "model." + name.removeprefix(prefix)
        text[renamed] = tensor
    return text


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
