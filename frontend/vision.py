"""A vision-language model's image side as the compile needs it: the encoder (vision tower and projector)
as a torch module with its weights, the types of its inputs, and what the runtime needs to turn an image
into the rows that take its placeholder tokens' places (runtime/vision.py's VisionSpec, written into the
artifact's manifest as `vision`).

Families: LLaVA (CLIP + MLP projector, `LlavaForConditionalGeneration` directories), Idefics3 /
SmolVLM (SigLIP over each tile + pixel shuffle + connector, `Idefics3ForConditionalGeneration`) and
Gemma 3 (SigLIP + average pool + norm + projection, `Gemma3ForConditionalGeneration`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from kiln.errors import ModelLoadError
from kiln.frontend.config import ModelConfig
from kiln.frontend.source import ModelSource, VisionSource, float32
from kiln.ir import Program
from kiln.ir.vision import VisionSpec

PREPROCESSOR_FILE = "preprocessor_config.json"
ENCODE_IMAGE = "encode_image"


def encoder_program(vision: VisionSource) -> Program:
    """The encoder captured with torch.fx into Kiln IR (float32)."""
    from kiln.frontend.capture import capture_module

    graph = capture_module(vision.module.eval(), vision.input_types, ENCODE_IMAGE)
    return Program(graph, {p.name: vision.module.get_parameter(p.name).detach() for p in graph.params})


def llava_vision(
    path: Path, config: dict[str, Any], weights: dict[str, Any], image_token: str
) -> VisionSource:
    """A LLaVA directory's encoder; `image_token`: the placeholder's text (the tokenizer's for the
    config's image_token_index)."""
    from kiln.frontend.models.clip_vision import (
        ClipVisionConfig,
        ClipVisionProjector,
        from_llava_weights,
        input_types,
    )

    vision = ClipVisionConfig.from_llava(config)
    module = ClipVisionProjector(vision)
    module.load_state_dict(from_llava_weights(vision, _float32(weights)), strict=True)
    token_id = config.get("image_token_index", config.get("image_token_id"))
    if not isinstance(token_id, int):
        raise ModelLoadError(
            f"{path}/config.json: no image_token_index", hint="the LLaVA config is incomplete"
        )
    spec = VisionSpec(
        family="llava",
        inputs="clip",
        preprocessor=read_preprocessor(path),
        image_token=image_token,
        image_token_id=token_id,
        num_image_tokens=vision.num_image_tokens,
        first_row=0 if vision.keep_class_token else 1,
        patch_size=vision.patch_size,
        hidden_size=vision.text_hidden_size,
    )
    return VisionSource(spec, module, input_types(vision))


def language_model_config(
    config: dict[str, Any], where: str, family: str, architectures: dict[str, str], default_type: str
) -> dict[str, Any]:
    """A vision-language config's `text_config`, as if its language model were saved on its own (as the
    causal LM `architectures` names for its model_type)."""
    text = dict(config.get("text_config") or {})
    model_type = text.get("model_type", default_type)
    if model_type not in architectures:
        raise ModelLoadError(
            f"{where}: {family}'s language model type {model_type!r} is not supported",
            hint=f"supported: {', '.join(sorted(architectures))}",
        )
    text["architectures"] = [architectures[model_type]]
    for key in ("tie_word_embeddings", "eos_token_id"):
        if key in config and key not in text:
            text[key] = config[key]
    return text


# where transformers versions saved a LLaVA-style model's language model (4.x early, 4.5x, 5.x) and head
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."))
_LANGUAGE_MODEL_HEAD = ("language_model.lm_head.", "lm_head.")


def language_model_weights(weights: dict[str, Any], vision_prefixes: tuple[str, ...]) -> dict[str, Any]:
    """A LLaVA-style checkpoint's (LLaVA's, Gemma 3's) language model tensors under the names a causal
    LM saves (`model.layers.0...`, `lm_head`); the encoder's (names under `vision_prefixes`) left out."""
    text: dict[str, Any] = {}
    for name, tensor in weights.items():
        if name.startswith(vision_prefixes):
            continue
        renamed = name
        for old, new in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(old):
                renamed = new + name.removeprefix(old)
        old, new = _LANGUAGE_MODEL_HEAD
        if name.startswith(old):
            renamed = new + name.removeprefix(old)
        text[renamed] = tensor
    return text


def with_images(config: ModelConfig, vision: VisionSource) -> ModelConfig:
    """The language model's config for a step with `vision`'s image rows."""
    return dataclasses.replace(config, image_rows=True, bidirectional_images=vision.spec.bidirectional)


def read_preprocessor(path: Path) -> dict[str, Any]:
    """The directory's preprocessor_config.json (the compile checks it with the runtime's reader)."""
    file = path / PREPROCESSOR_FILE
    if not file.is_file():
        raise ModelLoadError(
            f"{path}: no {PREPROCESSOR_FILE}",
            hint="a vision-language model's directory needs its image processor's config; download it too",
        )
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{file}: {error}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{file}: expected a JSON object", hint="the file is corrupt")
    return config


def idefics3_vision(
    config: dict[str, Any],
    weights: dict[str, Any],
    preprocessor: dict[str, Any],
    image_token: str,
    image_token_id: int,
) -> VisionSource:
    """An Idefics3 encoder (a directory's or an mmproj file's): one tile's patches in, its image tokens'
    rows out."""
    from kiln.frontend.models.idefics3_vision import (
        Idefics3VisionConfig,
        Idefics3VisionProjector,
        from_idefics3_weights,
        input_types,
    )

    vision = Idefics3VisionConfig.from_idefics3(config)
    module = Idefics3VisionProjector(vision)
    module.load_state_dict(from_idefics3_weights(vision, _float32(weights)), strict=True)
    spec = VisionSpec(
        family="idefics3",
        inputs="siglip",
        preprocessor=preprocessor,
        image_token=image_token,
        image_token_id=image_token_id,
        num_image_tokens=vision.num_tokens,
        first_row=0,
        patch_size=vision.patch_size,
        hidden_size=vision.text_hidden_size,
    )
    return VisionSource(spec, module, input_types(vision))


def gemma3_vision(
    config: dict[str, Any],
    weights: dict[str, Any],
    preprocessor: dict[str, Any],
    image_token: tuple[str, int],
    start_token: tuple[str, int],
    end_token: str,
    around: str = "\n\n",
) -> VisionSource:
    """A Gemma 3 encoder: the image's patches in, its `mm_tokens_per_image` rows out. A prompt marks an
    image with the start token, which becomes the image's text: `around`, the start token, the image's
    tokens, the end token, `around` (Gemma3Processor's; llama.cpp's has nothing around); the image's
    tokens attend to one another both ways."""
    from kiln.frontend.models.gemma3_vision import (
        Gemma3VisionConfig,
        Gemma3VisionProjector,
        from_gemma3_weights,
        input_types,
    )

    vision = Gemma3VisionConfig.from_gemma3(config)
    module = Gemma3VisionProjector(vision)
    module.load_state_dict(from_gemma3_weights(vision, _float32(weights)), strict=True)
    (image_text, image_id), (start_text, start_id) = image_token, start_token
    spec = VisionSpec(
        family="gemma3",
        inputs="siglip",
        preprocessor=preprocessor,
        image_token=image_text,
        image_token_id=image_id,
        num_image_tokens=vision.tokens_per_image,
        first_row=0,
        patch_size=vision.patch_size,
        hidden_size=vision.text_hidden_size,
        prompt_token=start_text,
        prompt_token_id=start_id,
        image_text=f"{around}{start_text}{image_text * vision.tokens_per_image}{end_token}{around}",
        bidirectional=True,
    )
    return VisionSource(spec, module, input_types(vision))


def _float32(weights: dict[str, Any]) -> dict[str, torch.Tensor]:
    from kiln.ir.deferred import materialize

    return {name: materialize(float32(tensor)) for name, tensor in weights.items()}


def image_token_text(tokenizer_json: str, token_id: Any, path: Path) -> str:
    """The placeholder token's text, as the model's tokenizer spells its id."""
    from tokenizers import Tokenizer

    token = Tokenizer.from_str(tokenizer_json).id_to_token(token_id) if isinstance(token_id, int) else None
    if token is None:
        raise ModelLoadError(
            f"{path}: the tokenizer has no token {token_id!r} (the config's image token)",
            hint="the tokenizer and config.json are of different models",
        )
    return token


MMPROJ_IMAGE_TOKEN = "<image>"  # the placeholder an Idefics3 / SmolVLM vocabulary has
GEMMA3_TOKENS = ("<image_soft_token>", "<start_of_image>", "<end_of_image>")  # a Gemma 3 vocabulary's


def with_mmproj(source: ModelSource, path: Path) -> ModelSource:
    """A GGUF model with the image encoder llama.cpp's converter wrote beside it (--mmproj). A Gemma 3
    image's prompt text is llama.cpp's (its start token, its tokens, its end token: no blank lines around
    it as transformers' processor writes)."""
    from kiln.frontend.mmproj import read_mmproj

    encoder = read_mmproj(path)
    width = int(encoder.config["text_config"]["hidden_size"])
    if width != source.config.hidden_size:
        raise ModelLoadError(
            f"{path}: the encoder's rows are {width} wide, the model's hidden size is "
            f"{source.config.hidden_size}",
            hint="pass the mmproj file converted from the same model",
        )
    if encoder.kind == "gemma3":
        image, start, end = (_vocabulary_token(source, token) for token in GEMMA3_TOKENS)
        vision = gemma3_vision(
            encoder.config, encoder.tensors, encoder.preprocessor, image, start, end[0], ""
        )
    else:
        image_token, token_id = _vocabulary_token(source, MMPROJ_IMAGE_TOKEN)
        vision = idefics3_vision(encoder.config, encoder.tensors, encoder.preprocessor, image_token, token_id)
    return dataclasses.replace(source, config=with_images(source.config, vision), vision=vision)


def _vocabulary_token(source: ModelSource, token: str) -> tuple[str, int]:
    from tokenizers import Tokenizer

    token_id = Tokenizer.from_str(source.tokenizer.tokenizer_json).token_to_id(token)
    if token_id is None:
        raise ModelLoadError(f"{source.path}: the vocabulary has no {token} token for images")
    return token, token_id
