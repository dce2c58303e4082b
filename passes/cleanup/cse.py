"""Common-subexpression elimination: one node per (op, inputs, attributes) among pure nodes."""

from __future__ import annotations

import json

from kiln.ir import Program, get_op
from kiln.passes.base import Pass, PassOptions
from kiln.passes.rewriter import Rewriter


def cse(program: Program, options: PassOptions) -> tuple[Program, bool]:
    rewriter = Rewriter(program)
    seen: dict[str, tuple] = {}
    for node in program.graph.nodes:
        if not get_op(node.op).pure:
            rewriter.keep(node)
            continue
        inputs = [rewriter.value(v) for v in node.inputs]
        key = json.dumps([node.op, [v.ref() if v else None for v in inputs], node.attrs], sort_keys=True)
        earlier = seen.get(key)
        if earlier is None:
            seen[key] = node.outputs
            rewriter.keep(node)
            continue
        for old, new in zip(node.outputs, earlier, strict=True):
            rewriter.replace(old, new)
    return rewriter.finish(), rewriter.changed


CSE = Pass("cse", cse, "merge pure nodes that compute the same thing")
