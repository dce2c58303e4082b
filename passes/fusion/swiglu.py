"""SiLU(gate) * up becomes one swiglu op; when gate and up are the two halves of one split (a fused
gate/up projection), swiglu reads the fused output directly."""

from __future__ import annotations

from kiln.ir import Node, Program, Value
from kiln.passes.base import Pass, PassOptions
from kiln.passes.rewriter import Rewriter, producers, use_counts


def _halves_of_one_split(
    gate: Value, up: Value, made_by: dict[str, Node], uses: dict[str, int]
) -> Value | None:
    split = made_by.get(gate.name)
    if split is None or split.op != "split" or made_by.get(up.name) is not split or len(split.outputs) != 2:
        return None
    first, second = split.outputs
    if (first.name, second.name) != (gate.name, up.name) or first.type.shape != second.type.shape:
        return None
    if uses.get(first.name) != 1 or uses.get(second.name) != 1:
        return None
    return split.inputs[0]


def fuse_swiglu(program: Program, options: PassOptions) -> tuple[Program, bool]:
    graph = program.graph
    made_by, uses = producers(graph), use_counts(graph)
    rewriter = Rewriter(program)
    for node in graph.nodes:
        if node.op == "mul":
            a, b = node.inputs
            assert a is not None and b is not None
            silu = made_by.get(a.name)
            if silu is not None and silu.op == "silu" and uses.get(a.name) == 1:
                gate = silu.inputs[0]
                assert gate is not None
                fused_input = _halves_of_one_split(gate, b, made_by, uses)
                inputs = [fused_input] if fused_input is not None else [gate, b]
                (out,) = rewriter.emit("swiglu", inputs, source=node.source)
                rewriter.replace(node.outputs[0], out)
                continue
        rewriter.keep(node)
    return rewriter.finish(), rewriter.changed


FUSE_SWIGLU = Pass("fuse_swiglu", fuse_swiglu, "silu(gate) * up → swiglu")
