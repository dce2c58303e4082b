"""Load a Hugging Face checkpoint directory (config.json + safetensors) into a ModelSource."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from kiln.errors import ModelLoadError
from kiln.frontend import gemma3, idefics3, llava
from kiln.frontend.config import BARE_DECODERS, ModelConfig, config_from_hf
from kiln.frontend.hf_quantization import (
    checkpoint_weights,
    read_quantization,
    refuse_unlabelled_quantization,
)
from kiln.frontend.models import adapt_hf_weights
from kiln.frontend.safetensors_file import mapped_tensors
from kiln.frontend.source import ModelSource, QuantizedTensor, Weight
from kiln.frontend.vision import with_images

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
logger = logging.getLogger(__name__)


def load_hf_dir(path: Path) -> ModelSource:
    """Read `config.json`, the safetensors weights (single, sharded or loose) and the tokenizer."""
    from kiln.frontend.hf_tokenizer import tokenizer_info_from_hf_dir

    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(
            f"{path}: not a directory", hint="pass a HF checkpoint directory holding config.json"
        )
    config = _with_generation_eos(read_config(path), path)
    config = dataclasses.replace(config, pooling=sentence_transformers_pooling(path))
    raw_weights = read_weights(path)
    headless = not any(name.endswith("lm_head.weight") for name in raw_weights)
    if config.architecture in BARE_DECODERS and headless:
        # an embedding model saved without its head: its embedding table stands in (for logits only)
        config = dataclasses.replace(config, tie_word_embeddings=True)
    tokenizer = tokenizer_info_from_hf_dir(path)
    vision = None
    raw_config = _read_json(path / "config.json")
    family = _vision_language_family(raw_config)
    if family is not None:
        vision = family.vision(path, raw_config, raw_weights, tokenizer.tokenizer_json)
        raw_weights = family.text_weights(raw_weights)
        config = with_images(config, vision)
    return ModelSource(
        name=path.resolve().name,
        path=path,
        config=config,
        weights=text_weights(config, raw_weights),
        tokenizer=tokenizer,
        vision=vision,
    )


def load_hf_weights(path: Path) -> tuple[ModelConfig, dict[str, Weight]]:
    """A text model's config and weights as `load_hf_dir` holds them, without its tokenizer (a trainer's
    checkpoint of a served model's weights)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: no config.json", hint="pass a HF checkpoint directory")
    if _vision_language_family(_read_json(path / "config.json")) is not None:
        raise ModelLoadError(f"{path}: a vision-language model", hint="pass a text model's checkpoint")
    config = read_config(path)
    return config, text_weights(config, read_weights(path))


def text_weights(config: ModelConfig, raw_weights: dict[str, Weight]) -> dict[str, Weight]:
    """HF-named weights as the model definition names them (a bare decoder's, saved without the causal LM
    around it as embedding models are, under `model.`)."""
    if not any(name.startswith("model.") for name in raw_weights) and "norm.weight" in raw_weights:
        raw_weights = {f"model.{name}": weight for name, weight in raw_weights.items()}
    weights = adapt_hf_weights(config, raw_weights)
    if config.tie_word_embeddings:
        # Some checkpoints save the tied head too; a tied model has no lm_head of its own.
        weights.pop("lm_head.weight", None)
    return weights


def read_config(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(
            f"{path}: no config.json",
            hint="a HF checkpoint directory needs config.json; download the full model repository",
        )
    raw = _read_json(config_file)
    family = _vision_language_family(raw)
    if family is not None:
        raw = family.text_config(raw, str(config_file))
    return config_from_hf(raw, str(config_file))


ST_POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


def sentence_transformers_pooling(path: Path) -> str | None:
    """The pooling of a sentence-transformers model folder (modules.json naming a Pooling module whose
    config sets one of ST_POOLING_MODES); None for a folder without one. Another mode (CLS, max) is an
    error: this runtime does not pool so."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{modules_file}: cannot read JSON ({error})", hint="corrupt file") from None
    for module in modules if isinstance(modules, list) else []:
        if isinstance(module, dict) and str(module.get("type", "")).endswith(".Pooling"):
            pooling_file = path / str(module.get("path", "")) / "config.json"
            modes = _read_json(pooling_file)
            chosen = [name for name, value in modes.items() if name.startswith("pooling_mode_") and value]
            if len(chosen) == 1 and chosen[0] in ST_POOLING_MODES:
                return ST_POOLING_MODES[chosen[0]]
            raise ModelLoadError(
                f"{pooling_file}: pooling {', '.join(chosen) or 'none'} is not supported",
                hint="kiln pools by the last token or the mean (pooling_mode_lasttoken, "
                "pooling_mode_mean_tokens)",
            )
    return None


def _vision_language_family(config: dict[str, Any]) -> Any:
    """The module reading a vision-language checkpoint of this config's architecture (llava.py,
    idefics3.py, gemma3.py), or None for a text model."""
    families = {llava.ARCHITECTURE: llava, idefics3.ARCHITECTURE: idefics3, gemma3.ARCHITECTURE: gemma3}
    for architecture in config.get("architectures") or []:
        if architecture in families:
            return families[architecture]
    return None


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{file}: cannot read JSON ({error})", hint="the file is corrupt") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file}: expected a JSON object", hint="the file is corrupt")
    return data


def _with_generation_eos(config: ModelConfig, path: Path) -> ModelConfig:
    """Add `generation_config.json`'s eos ids (chat models often stop on more than config.json says)."""
    generation_file = path / "generation_config.json"
    if not generation_file.is_file():
        return config
    eos = _read_json(generation_file).get("eos_token_id")
    extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    merged = list(config.eos_token_ids)
    merged += [int(token) for token in extra if int(token) not in merged]
    return dataclasses.replace(config, eos_token_ids=tuple(merged))


def weight_files(path: Path) -> list[Path]:
    """The safetensors files holding the weights: the index's shards, the single file, or all of them."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: no weight_map", hint="the index file is corrupt")
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        missing = [file.name for file in files if not file.is_file()]
        if missing:
            raise ModelLoadError(
                f"{path}: shards named in {INDEX_FILE} are missing: {', '.join(missing)}",
                hint="download the missing shards",
            )
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{path}: no safetensors weights ({SINGLE_FILE}, {INDEX_FILE} or *.safetensors)",
            hint="download the model's .safetensors files; .bin (pickle) checkpoints are not supported",
        )
    return files


def holds_blocks(path: Path) -> bool:
    """Whether the checkpoint at `path` is pre-quantized in a format kept as GGUF blocks (headers only)."""
    return any(isinstance(weight, QuantizedTensor) for weight in read_weights(path).values())


def read_weights(path: Path) -> dict[str, Weight]:
    """The checkpoint's tensors by name, mapped and deferred (read when materialized, one at a time); a
    pre-quantized checkpoint's linears as GGUF blocks that hold them exactly, or as their float values
    (frontend/hf_quantization.py). A
    quantization this runtime does not load is refused before any tensor is read."""
    quantization = (
        read_quantization(_read_json(path / "config.json"), path)
        if (path / "config.json").is_file()
        else None
    )
    weights: dict[str, Weight] = {}
    for file in weight_files(path):
        for name, tensor in mapped_tensors(file).items():
            if name in weights:
                raise ModelLoadError(
                    f"{file}: tensor {name!r} is also in another shard", hint="the checkpoint is inconsistent"
                )
            weights[name] = tensor
    if quantization is None:
        refuse_unlabelled_quantization(weights, path / "config.json")
        return weights
    logger.info("%s: %s", path, quantization.description)
    return checkpoint_weights(weights, quantization, path / "config.json")
