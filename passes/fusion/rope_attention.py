"""rope(q) and rope(k) feeding paged_attention move into the attention op's input stage."""

from __future__ import annotations

from kiln.ir import Node, Program
from kiln.passes.base import Pass, PassOptions
from kiln.passes.rewriter import Rewriter, producers, use_counts


def _rope_pair(attention: Node, made_by: dict[str, Node], uses: dict[str, int]) -> tuple[Node, Node] | None:
    if attention.op != "paged_attention" or "rope" in attention.attrs:
        return None
    q, k = attention.inputs[0], attention.inputs[1]
    assert q is not None and k is not None
    rope_q, rope_k = made_by.get(q.name), made_by.get(k.name)
    if rope_q is None or rope_k is None or rope_q.op != "rope" or rope_k.op != "rope":
        return None
    if rope_q.attrs != rope_k.attrs or rope_q.inputs[1] != rope_k.inputs[1]:
        return None
    if uses.get(q.name) != 1 or uses.get(k.name) != 1:
        return None
    return rope_q, rope_k


def fuse_rope_attention(program: Program, options: PassOptions) -> tuple[Program, bool]:
    graph = program.graph
    made_by, uses = producers(graph), use_counts(graph)
    pairs = {id(node): pair for node in graph.nodes if (pair := _rope_pair(node, made_by, uses))}
    if not pairs:
        return program, False
    absorbed = {id(rope) for pair in pairs.values() for rope in pair}
    rewriter = Rewriter(program)
    for node in graph.nodes:
        if id(node) in absorbed:
            continue
        pair = pairs.get(id(node))
        if pair is None:
            rewriter.keep(node)
            continue
        rope_q, rope_k = pair
        inputs = [rope_q.inputs[0], rope_k.inputs[0], *node.inputs[2:8], rope_q.inputs[1], *node.inputs[9:]]
        (out,) = rewriter.emit("paged_attention", inputs, {**node.attrs, "rope": rope_q.attrs}, node.source)
        rewriter.replace(node.outputs[0], out)
    return rewriter.finish(), True


FUSE_ROPE_ATTENTION = Pass("fuse_rope_attention", fuse_rope_attention, "rope → paged_attention's input stage")
