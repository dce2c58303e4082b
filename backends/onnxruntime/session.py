"""ONNX Runtime session settings: chosen at compile time, recorded in the manifest, applied at load."""

from __future__ import annotations

import os
from typing import Any

import onnxruntime as ort

from kiln.backends.base import BackendError, CompileSettings
from kiln.backends.targets import Target

# ORT_ENABLE_ALL: the extended fusions (SimplifiedLayerNormalization, ...) and the layout ones.
OPTIMIZATION_LEVEL = "ORT_ENABLE_ALL"
_LEVELS = {
    "ORT_DISABLE_ALL": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "ORT_ENABLE_BASIC": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "ORT_ENABLE_EXTENDED": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "ORT_ENABLE_ALL": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def session_config(target: Target, settings: CompileSettings) -> dict[str, Any]:
    """What the manifest records and `load` applies."""
    config: dict[str, Any] = {
        "graph_optimization_level": OPTIMIZATION_LEVEL,
        "execution_mode": "ORT_SEQUENTIAL",
        "intra_op_num_threads": settings.num_threads or 0,  # 0: all cores (resolved at load)
        "inter_op_num_threads": 1,
    }
    if target.kind == "cuda":
        config["providers"] = [
            [
                "CUDAExecutionProvider",
                {
                    "device_id": "0",
                    "arena_extend_strategy": "kSameAsRequested",
                    "do_copy_in_default_stream": "1",
                },
            ],
            ["CPUExecutionProvider", {}],
        ]
    else:
        config["providers"] = [["CPUExecutionProvider", {}]]
    return config


def session_options(config: dict[str, Any]) -> ort.SessionOptions:
    options = ort.SessionOptions()
    level = config.get("graph_optimization_level", OPTIMIZATION_LEVEL)
    if level not in _LEVELS:
        raise BackendError(f"unknown graph optimization level {level!r} in the artifact")
    options.graph_optimization_level = _LEVELS[level]
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = int(config.get("intra_op_num_threads") or os.cpu_count() or 1)
    options.inter_op_num_threads = int(config.get("inter_op_num_threads", 1))
    options.log_severity_level = 3
    return options


def providers(config: dict[str, Any]) -> list[tuple[str, dict[str, str]]]:
    wanted = [(name, dict(opts)) for name, opts in config.get("providers", [["CPUExecutionProvider", {}]])]
    available = set(ort.get_available_providers())
    missing = [name for name, _ in wanted if name not in available]
    if missing:
        raise BackendError(
            f"this onnxruntime has no {missing[0]} (it has {', '.join(sorted(available))})",
            hint="install onnxruntime-gpu for CUDA targets",
        )
    return wanted
