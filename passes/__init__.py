"""Rewrite IR into better IR: a pass manager, cleanup, fusions, quantization, dtype, memory planning.

Names are imported on first use (the options' vocabulary in base.py needs none of the passes)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.passes.base import Pass, PassError, PassOptions
    from kiln.passes.manager import PassManager, PassReport
    from kiln.passes.pipelines import PIPELINES, passes_by_name, pipeline

_MODULE_OF = {
    "Pass": "base",
    "PassError": "base",
    "PassOptions": "base",
    "PassManager": "manager",
    "PassReport": "manager",
    "PIPELINES": "pipelines",
    "passes_by_name": "pipelines",
    "pipeline": "pipelines",
}

__all__ = [
    "PIPELINES",
    "Pass",
    "PassError",
    "PassManager",
    "PassOptions",
    "PassReport",
    "passes_by_name",
    "pipeline",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'kiln.passes' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kiln.passes.{module}"), name)
    globals()[name] = value
    return value
