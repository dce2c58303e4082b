"""Dead-code elimination: drop pure nodes none of whose outputs is used, and params nobody reads."""

from __future__ import annotations

from kiln.ir import Graph, Program
from kiln.passes.base import Pass, PassOptions
from kiln.passes.rewriter import live_nodes


def dce(program: Program, options: PassOptions | None) -> tuple[Program, bool]:
    graph = program.graph
    kept = live_nodes(graph.nodes, graph.outputs)
    read = {v.name for node in kept for v in node.inputs if v is not None} | {v.name for v in graph.outputs}
    params = [p for p in graph.params if p.name in read]
    changed = len(kept) != len(graph.nodes) or len(params) != len(graph.params)
    new_graph = Graph(graph.name, list(graph.inputs), params, kept, list(graph.outputs))
    return Program(new_graph, {p.name: program.weights[p.name] for p in params}), changed


DCE = Pass("dce", dce, "remove unused pure nodes and params")
