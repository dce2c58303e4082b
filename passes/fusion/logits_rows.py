"""Compute the LM head (and whatever row-wise work leads to it) only for the `logits_indices` rows:
take_rows moves above row-wise ops whose result nothing else reads, so a prefill computes logits for
one token per sequence instead of all of them."""

from __future__ import annotations

from kiln.ir import Node, Program
from kiln.passes.base import Pass, PassOptions
from kiln.passes.rewriter import Rewriter, producers, use_counts

# ops that act on each row on its own; the listed inputs are per-row, the others are weights
_ROW_WISE: dict[str, tuple[int, ...]] = {
    "linear": (0,),
    "quantized_linear": (0,),
    "rms_norm": (0,),
    "silu": (0,),
    "swiglu": (0, 1),
    "cast": (0,),
    "add": (0, 1),
    "mul": (0, 1),
    "moe": (0, 1),  # x and its router logits
    "quantized_moe": (0, 1),
    "lora": (0, 1, 2),  # y, x and the rows' adapter slots
}


def _row_wise(node: Node) -> bool:
    rows = node.outputs[0].type.shape[:1]
    if node.op not in _ROW_WISE or len(node.outputs) != 1:
        return False
    return all(
        node.inputs[i] is None or node.inputs[i].type.shape[:1] == rows
        for i in _ROW_WISE[node.op]
        if i < len(node.inputs)
    )


def push_take_rows(program: Program, options: PassOptions) -> tuple[Program, bool]:
    graph = program.graph
    made_by, uses = producers(graph), use_counts(graph)
    target = None
    for node in graph.nodes:
        if node.op != "take_rows":
            continue
        source = node.inputs[0]
        assert source is not None
        inner = made_by.get(source.name)
        if inner is not None and uses.get(source.name) == 1 and _row_wise(inner):
            target = (node, inner)
            break
    if target is None:
        return program, False
    take, inner = target
    indices = take.inputs[1]
    rewriter = Rewriter(program)
    for node in graph.nodes:
        if node is inner:
            continue
        if node is not take:
            rewriter.keep(node)
            continue
        inputs = list(inner.inputs)
        for i in _ROW_WISE[inner.op]:
            if i < len(inputs) and inputs[i] is not None:
                (inputs[i],) = rewriter.emit("take_rows", [inputs[i], indices], source=take.source)
        (out,) = rewriter.emit(inner.op, inputs, inner.attrs, inner.source)
        rewriter.replace(take.outputs[0], out)
    return rewriter.finish(), True


PUSH_TAKE_ROWS = Pass("push_take_rows", push_take_rows, "compute the LM head only for logits_indices rows")
