"""One entry point for every model source: a known name, a GGUF file, or a HF checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.errors import ModelLoadError
from kiln.frontend.config import QUANTIZATION_SIDE_FILES
from kiln.frontend.gguf_header import QUANTIZED_TYPES, gguf_tensor_types
from kiln.frontend.pull import resolve_model

if TYPE_CHECKING:
    from kiln.frontend.source import ModelSource


def load_model(name_or_path: str, mmproj: Path | None = None) -> ModelSource:
    """Load a known model name (pulled if needed), a `.gguf` file (`mmproj`: its image encoder, as
    llama.cpp's converter writes it), or a model directory."""
    path = resolve_model(name_or_path)
    gguf_file = _gguf_file(path)
    if gguf_file is not None:
        from kiln.frontend.gguf_loader import load_gguf  # the loaders (torch) only for a load

        source = load_gguf(gguf_file)
        if mmproj is not None:
            from kiln.frontend.vision import with_mmproj

            source = with_mmproj(source, mmproj)
        return source
    if mmproj is not None:
        raise ModelLoadError(
            f"{path}: --mmproj goes with a GGUF model file",
            hint="a HF directory of a vision-language model holds its own image encoder; drop --mmproj",
        )
    if path.is_dir():
        return _load_dir(path)
    raise ModelLoadError(
        f"{path}: neither a GGUF file nor a model directory",
        hint="pass a .gguf file, a HF checkpoint directory with config.json, or a known model name",
    )


def holds_gguf_blocks(name_or_path: str) -> bool:
    """Whether the model holds quantized GGUF blocks a compile can keep as they are: a GGUF with quantized
    tensors, or a pre-quantized HF checkpoint whose weights map onto blocks exactly
    (frontend/hf_quantization.py); reads headers only."""
    path = resolve_model(name_or_path)
    gguf_file = _gguf_file(path)
    if gguf_file is not None:
        return any(kind in QUANTIZED_TYPES for kind in gguf_tensor_types(gguf_file))
    if path.is_dir() and _names_a_quantization(path):
        from kiln.frontend.hf_loader import holds_blocks  # torch: only for a pre-quantized checkpoint

        return holds_blocks(path)
    return False


def _names_a_quantization(folder: Path) -> bool:
    """Whether a HF folder's config.json (or an older tool's file beside it) names a quantization; a
    config that cannot be read names none here (loading the model says what is wrong with it)."""
    if any((folder / name).is_file() for name in QUANTIZATION_SIDE_FILES):
        return True
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(config, dict) and config.get("quantization_config") is not None


def _gguf_file(path: Path) -> Path | None:
    """The GGUF file `path` names: itself, or the one .gguf of a directory that is not a HF checkpoint
    (no config.json); None for anything else."""
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        return ggufs[0] if len(ggufs) == 1 and not (path / "config.json").is_file() else None
    return path if path.suffix == ".gguf" or _has_gguf_magic(path) else None


def _load_dir(path: Path) -> ModelSource:
    """A HF checkpoint directory, or the reason a directory is no model."""
    if (path / "config.json").is_file():
        from kiln.frontend.hf_loader import load_hf_dir

        return load_hf_dir(path)
    ggufs = sorted(path.glob("*.gguf"))
    if ggufs:
        raise ModelLoadError(
            f"{path}: holds {len(ggufs)} GGUF files ({', '.join(file.name for file in ggufs)})",
            hint="pass the path of the one to load",
        )
    raise ModelLoadError(
        f"{path}: no model in this directory (no config.json, no .gguf file)",
        hint="pass a .gguf file, or a HF checkpoint directory with config.json and safetensors weights",
    )


def _has_gguf_magic(path: Path) -> bool:
    try:
        with path.open("rb") as file:
            return file.read(4) == b"GGUF"
    except OSError:
        return False
