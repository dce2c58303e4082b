"""Rewrite IR into better IR: a pass manager, cleanup, fusions, quantization, dtype, memory planning."""

from kiln.passes.base import Pass, PassError, PassOptions
from kiln.passes.manager import PassManager, PassReport
from kiln.passes.pipelines import PIPELINES, passes_by_name, pipeline

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
