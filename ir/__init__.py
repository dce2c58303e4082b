"""Kiln's graph IR: typed SSA values, registered ops, verifier, text form and serialization.

Names are imported on first use, so that the step contract (`kiln.ir.step`) is usable by a serving
process without loading the ops' torch reference implementations."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.ir.builder import GraphBuilder
    from kiln.ir.errors import IRError
    from kiln.ir.graph import Graph, Node, Value, ValueKind
    from kiln.ir.ops import REGISTRY, OpDef, get_op
    from kiln.ir.program import Program
    from kiln.ir.serialize import graph_from_json, graph_to_json, load_weights, save_weights
    from kiln.ir.step import (
        IMAGE_ROWS_INPUT,
        KV_CACHE_INPUT,
        LORA_SLOTS_INPUT,
        STEP_INPUT_TYPES,
        VISIBLE_ENDS_INPUT,
        StepInputs,
        kv_cache_type,
    )
    from kiln.ir.text import parse_graph, print_graph, structural_equal
    from kiln.ir.types import DTYPES, QuantLayout, TensorType
    from kiln.ir.verifier import verify

_MODULE_OF = {
    "GraphBuilder": "builder",
    "IRError": "errors",
    "Graph": "graph",
    "Node": "graph",
    "Value": "graph",
    "ValueKind": "graph",
    "REGISTRY": "ops",
    "OpDef": "ops",
    "get_op": "ops",
    "Program": "program",
    "graph_from_json": "serialize",
    "graph_to_json": "serialize",
    "load_weights": "serialize",
    "save_weights": "serialize",
    "IMAGE_ROWS_INPUT": "step",
    "VISIBLE_ENDS_INPUT": "step",
    "KV_CACHE_INPUT": "step",
    "LORA_SLOTS_INPUT": "step",
    "STEP_INPUT_TYPES": "step",
    "StepInputs": "step",
    "kv_cache_type": "step",
    "parse_graph": "text",
    "print_graph": "text",
    "structural_equal": "text",
    "DTYPES": "types",
    "QuantLayout": "types",
    "TensorType": "types",
    "verify": "verifier",
}
__all__ = [
    "DTYPES",
    "IMAGE_ROWS_INPUT",
    "KV_CACHE_INPUT",
    "LORA_SLOTS_INPUT",
    "REGISTRY",
    "STEP_INPUT_TYPES",
    "VISIBLE_ENDS_INPUT",
    "Graph",
    "GraphBuilder",
    "IRError",
    "Node",
    "OpDef",
    "Program",
    "QuantLayout",
    "StepInputs",
    "TensorType",
    "Value",
    "ValueKind",
    "get_op",
    "graph_from_json",
    "graph_to_json",
    "kv_cache_type",
    "load_weights",
    "parse_graph",
    "print_graph",
    "save_weights",
    "structural_equal",
    "verify",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'kiln.ir' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kiln.ir.{module}"), name)
    globals()[name] = value
    return value
