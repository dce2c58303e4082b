"""Rebuild a graph node by node: keep, drop or replace nodes, and remap later uses to new values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kiln.ir import Graph, Node, Program, TensorType, Value, ValueKind, get_op
from kiln.ir.builder import GraphBuilder


def producers(graph: Graph) -> dict[str, Node]:
    """Value name → the node that makes it."""
    return {value.name: node for node in graph.nodes for value in node.outputs}


def use_counts(graph: Graph) -> dict[str, int]:
    """Value name → how many node inputs and graph outputs read it."""
    counts: dict[str, int] = {}
    for node in graph.nodes:
        for value in node.inputs:
            if value is not None:
                counts[value.name] = counts.get(value.name, 0) + 1
    for value in graph.outputs:
        counts[value.name] = counts.get(value.name, 0) + 1
    return counts


def live_nodes(nodes: Sequence[Node], outputs: Sequence[Value]) -> list[Node]:
    """`nodes` without the pure ones whose outputs nothing reads (transitively)."""
    live = {v.name for v in outputs}
    kept = []
    for node in reversed(nodes):
        if get_op(node.op).pure and not any(v.name in live for v in node.outputs):
            continue
        kept.append(node)
        live.update(v.name for v in node.inputs if v is not None)
    kept.reverse()
    return kept


class Rewriter:
    """Walk `program.graph` once, emitting into a new graph. Values made by dropped nodes must be
    given replacements (`replace`) before a kept node reads them."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self.graph = program.graph
        self.weights = dict(program.weights)
        self._nodes: list[Node] = []
        self._mapping: dict[str, Value | None] = {}
        self._params: dict[str, Value] = {p.name: p for p in self.graph.params}
        numeric = [int(v.name) for n in self.graph.nodes for v in n.outputs if v.name.isdigit()]
        self._next_id = max(numeric, default=-1) + 1
        self.changed = False

    def value(self, value: Value | None) -> Value | None:
        if value is None:
            return None
        return self._mapping.get(value.name, value) if value.name in self._mapping else value

    def keep(self, node: Node) -> None:
        inputs = tuple(self.value(v) for v in node.inputs)
        if inputs != node.inputs:
            node = Node(node.op, inputs, node.outputs, node.attrs, node.source)
        self._nodes.append(node)

    def replace(self, old: Value, new: Value) -> None:
        self._mapping[old.name] = self.value(new)
        self.changed = True

    def emit(
        self,
        op: str,
        inputs: Sequence[Value | None],
        attrs: dict[str, Any] | None = None,
        source: str | None = None,
    ) -> list[Value]:
        """A new node; its inputs are remapped, its outputs named fresh and typed by the op's rule."""
        builder = GraphBuilder("scratch", first_id=self._next_id)
        outputs = builder.op(op, [self.value(v) for v in inputs], attrs=attrs, source=source)
        self._next_id = builder.next_id
        self._nodes.extend(builder.build(outputs).nodes)
        self.changed = True
        return outputs

    def add_param(self, name: str, tensor: Any) -> Value:
        value = Value(name, TensorType.of(tensor), ValueKind.PARAM)
        self._params[name] = value
        self.weights[name] = tensor
        self.changed = True
        return value

    def finish(self) -> Program:
        """The new program, without nodes and params that nothing reads any more."""
        outputs = [v for v in (self.value(v) for v in self.graph.outputs) if v is not None]
        if self.changed:
            self._nodes = live_nodes(self._nodes, outputs)
        used = {v.name for node in self._nodes for v in node.inputs if v is not None}
        params = [p for p in self._params.values() if p.name in used]
        graph = Graph(
            self.graph.name, list(self.graph.inputs), params, self._nodes, [v for v in outputs if v]
        )
        weights = {p.name: self.weights[p.name] for p in params}
        return Program(graph, weights)
