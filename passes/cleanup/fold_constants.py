"""Constant folding: a pure node whose inputs are all params is computed now and becomes a param."""

from __future__ import annotations

import torch

from kiln.ir import Program, ValueKind, get_op
from kiln.ir.deferred import materialize
from kiln.passes.base import Pass, PassOptions
from kiln.passes.rewriter import Rewriter


def fold_constants(program: Program, options: PassOptions) -> tuple[Program, bool]:
    rewriter = Rewriter(program)
    for node in program.graph.nodes:
        inputs = [rewriter.value(v) for v in node.inputs]
        foldable = get_op(node.op).pure and all(v is None or v.kind is ValueKind.PARAM for v in inputs)
        if not foldable:
            rewriter.keep(node)
            continue
        tensors = [materialize(rewriter.weights[v.name]) if v is not None else None for v in inputs]
        with torch.no_grad():
            result = get_op(node.op).reference(*tensors, **node.attrs)
        results = result if isinstance(result, tuple) else (result,)
        for index, (old, tensor) in enumerate(zip(node.outputs, results, strict=True)):
            name = f"folded.{node.op}.{old.name}" + (f".{index}" if len(results) > 1 else "")
            rewriter.replace(old, rewriter.add_param(name, tensor.contiguous()))
    return rewriter.finish(), rewriter.changed


FOLD_CONSTANTS = Pass("fold_constants", fold_constants, "compute nodes whose inputs are all weights")
