"""Dead-code elimination: drop pure nodes none of whose outputs is used, and params nobody reads."""

from __future__ import annotations

from kiln.ir import Graph, Program, get_op
from kiln.passes.base import Pass, PassOptions


def dce(program: Program, options: PassOptions) -> tuple[Program, bool]:
    graph = program.graph
    live = {v.name for v in graph.outputs}
    kept = []
    for node in reversed(graph.nodes):
        if get_op(node.op).pure and not any(v.name in live for v in node.outputs):
            continue
        kept.append(node)
        live.update(v.name for v in node.inputs if v is not None)
    kept.reverse()
    params = [p for p in graph.params if p.name in live]
    changed = len(kept) != len(graph.nodes) or len(params) != len(graph.params)
    new_graph = Graph(graph.name, list(graph.inputs), params, kept, list(graph.outputs))
    return Program(new_graph, {p.name: program.weights[p.name] for p in params}), changed


DCE = Pass("dce", dce, "remove unused pure nodes and params")
