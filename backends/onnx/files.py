"""The lowered model on disk: model.onnx (no weight bytes) and onnx.json (weight bindings, outputs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx

from kiln.backends.base import BackendError
from kiln.backends.onnx.lower import LoweredModel

MODEL_FILE = "model.onnx"
META_FILE = "onnx.json"


def write_lowered(lowered: LoweredModel, folder: Path, extra: dict[str, Any] | None = None) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save_model(lowered.model, str(folder / MODEL_FILE))
    meta = {**lowered.meta(), **(extra or {})}
    (folder / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return [MODEL_FILE, META_FILE]


def read_lowered(folder: Path) -> tuple[onnx.ModelProto, dict[str, Any]]:
    try:
        model = onnx.load_model(str(folder / MODEL_FILE))
        meta = json.loads((folder / META_FILE).read_text())
    except (OSError, json.JSONDecodeError, onnx.onnx_cpp2py_export.ONNXException) as error:  # type: ignore[attr-defined]
        raise BackendError(f"{folder}: cannot read the ONNX model ({error})") from None
    return model, meta
