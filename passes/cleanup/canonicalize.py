"""Canonicalisation: reshape chains become one reshape, transpose chains one transpose, and reshapes,
transposes and casts that change nothing disappear."""

from __future__ import annotations

from kiln.ir import Node, Program, Value
from kiln.passes.base import Pass, PassOptions
from kiln.passes.rewriter import Rewriter, producers


def _is_noop(node: Node, source: Value) -> bool:
    out = node.outputs[0].type
    if node.op == "reshape":
        return out.shape == source.type.shape
    if node.op == "transpose":
        return node.attrs["perm"] == list(range(out.rank))
    if node.op == "cast":
        return out.dtype == source.type.dtype
    return False


def canonicalize(program: Program, options: PassOptions) -> tuple[Program, bool]:
    graph = program.graph
    made_by = producers(graph)
    rewriter = Rewriter(program)
    for node in graph.nodes:
        if node.op not in ("reshape", "transpose", "cast"):
            rewriter.keep(node)
            continue
        source = node.inputs[0]
        assert source is not None
        inner = made_by.get(source.name)
        if inner is not None and inner.op == node.op and node.op in ("reshape", "transpose"):
            # read through the inner node; dce drops it if nothing else uses it
            original = inner.inputs[0]
            assert original is not None
            if node.op == "reshape":
                attrs = {"shape": list(node.outputs[0].type.shape)}
            else:
                attrs = {"perm": [inner.attrs["perm"][i] for i in node.attrs["perm"]]}
            (merged,) = rewriter.emit(node.op, [original], attrs, node.source)
            rewriter.replace(node.outputs[0], merged)
            continue
        if _is_noop(node, source):
            new_source = rewriter.value(source)
            assert new_source is not None
            rewriter.replace(node.outputs[0], new_source)
            continue
        rewriter.keep(node)
    return rewriter.finish(), rewriter.changed


CANONICALIZE = Pass(
    "canonicalize", canonicalize, "fold reshape/transpose chains, drop no-op shape ops and casts"
)
