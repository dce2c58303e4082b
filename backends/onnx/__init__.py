"""Lowering of kiln IR to ONNX, shared by the onnxruntime and tensorrt backends.

Names are imported on first use: asking a backend what it builds (capabilities.py) loads no lowering
and no torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.backends.onnx.check import check_model
    from kiln.backends.onnx.context import LoweringOptions
    from kiln.backends.onnx.files import META_FILE, MODEL_FILE, read_lowered, write_lowered
    from kiln.backends.onnx.lower import KV_OUTPUT, LoweredModel, check_lowerable, lower_program
    from kiln.backends.onnx.weights import WeightBinding, materialize

_MODULE_OF = {
    "check_model": "check",
    "LoweringOptions": "context",
    "META_FILE": "files",
    "MODEL_FILE": "files",
    "read_lowered": "files",
    "write_lowered": "files",
    "KV_OUTPUT": "lower",
    "LoweredModel": "lower",
    "check_lowerable": "lower",
    "lower_program": "lower",
    "WeightBinding": "weights",
    "materialize": "weights",
}

__all__ = [
    "KV_OUTPUT",
    "META_FILE",
    "MODEL_FILE",
    "LoweredModel",
    "LoweringOptions",
    "WeightBinding",
    "check_lowerable",
    "check_model",
    "lower_program",
    "materialize",
    "read_lowered",
    "write_lowered",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
