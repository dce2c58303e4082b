"""Graphs as JSON, weights as safetensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kiln.ir.errors import IRError
from kiln.ir.graph import Graph, Node, Value, ValueKind
from kiln.ir.types import TensorType

GRAPH_FORMAT_VERSION = 1


def _value_json(value: Value) -> dict[str, str]:
    return {"name": value.name, "type": value.type.text()}


def graph_to_json(graph: Graph) -> dict[str, Any]:
    return {
        "format_version": GRAPH_FORMAT_VERSION,
        "name": graph.name,
        "inputs": [_value_json(v) for v in graph.inputs],
        "params": [_value_json(v) for v in graph.params],
        "nodes": [
            {
                "op": node.op,
                "inputs": [v.ref() if v is not None else None for v in node.inputs],
                "outputs": [_value_json(v) for v in node.outputs],
                "attrs": node.attrs,
                "source": node.source,
            }
            for node in graph.nodes
        ],
        "outputs": [v.ref() for v in graph.outputs],
    }


def graph_from_json(data: dict[str, Any]) -> Graph:
    if data.get("format_version") != GRAPH_FORMAT_VERSION:
        raise IRError(
            f"graph format version {data.get('format_version')!r} is not {GRAPH_FORMAT_VERSION}",
            hint="recompile the model with this version of kiln",
        )
    values: dict[str, Value] = {}

    def define(raw: dict[str, str], kind: ValueKind) -> Value:
        value = Value(raw["name"], TensorType.parse(raw["type"]), kind)
        values[value.ref()] = value
        return value

    def lookup(ref: str) -> Value:
        if ref not in values:
            raise IRError(f"graph JSON refers to undefined value {ref}")
        return values[ref]

    inputs = [define(v, ValueKind.INPUT) for v in data["inputs"]]
    params = [define(v, ValueKind.PARAM) for v in data["params"]]
    nodes = []
    for raw in data["nodes"]:
        node_inputs = tuple(lookup(r) if r is not None else None for r in raw["inputs"])
        outputs = tuple(define(v, ValueKind.NODE) for v in raw["outputs"])
        nodes.append(Node(raw["op"], node_inputs, outputs, raw.get("attrs") or {}, raw.get("source")))
    return Graph(data["name"], inputs, params, nodes, [lookup(r) for r in data["outputs"]])


def save_weights(weights: dict[str, torch.Tensor], path: Path) -> None:
    save_file({name: t.contiguous() for name, t in sorted(weights.items())}, str(path))


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))
