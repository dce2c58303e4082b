"""Kiln's graph IR: typed SSA values, registered ops, verifier, text form and serialization."""

from kiln.ir.builder import GraphBuilder
from kiln.ir.errors import IRError
from kiln.ir.graph import Graph, Node, Value, ValueKind
from kiln.ir.ops import REGISTRY, OpDef, get_op
from kiln.ir.program import Program
from kiln.ir.serialize import graph_from_json, graph_to_json, load_weights, save_weights
from kiln.ir.step import KV_CACHE_INPUT, STEP_INPUT_TYPES, StepInputs, kv_cache_type
from kiln.ir.text import parse_graph, print_graph, structural_equal
from kiln.ir.types import DTYPES, QuantLayout, TensorType
from kiln.ir.verify import verify

__all__ = [
    "DTYPES",
    "KV_CACHE_INPUT",
    "REGISTRY",
    "STEP_INPUT_TYPES",
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
