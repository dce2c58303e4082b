"""A residual add feeding an RMSNorm becomes one add_rms_norm op returning both (normed, sum)."""

from __future__ import annotations

from kiln.ir import Program
from kiln.passes.base import Pass, PassOptions
from kiln.passes.rewriter import Rewriter, producers


def fuse_add_rms_norm(program: Program, options: PassOptions) -> tuple[Program, bool]:
    graph = program.graph
    made_by = producers(graph)
    norms_of_adds = {}
    for node in graph.nodes:
        if node.op == "rms_norm":
            source = node.inputs[0]
            assert source is not None
            add = made_by.get(source.name)
            if (
                add is not None
                and add.op == "add"
                and add.inputs[0].type.shape == add.outputs[0].type.shape
                and add.inputs[1].type.shape == add.outputs[0].type.shape
                and id(add) not in norms_of_adds
            ):
                norms_of_adds[id(add)] = node
    if not norms_of_adds:
        return program, False
    fused_norms = {id(norm) for norm in norms_of_adds.values()}
    rewriter = Rewriter(program)
    for node in graph.nodes:
        if id(node) in fused_norms:
            continue
        norm = norms_of_adds.get(id(node))
        if norm is None:
            rewriter.keep(node)
            continue
        normed, total = rewriter.emit(
            "add_rms_norm", [node.inputs[0], node.inputs[1], norm.inputs[1]], norm.attrs, norm.source
        )
        rewriter.replace(node.outputs[0], total)
        rewriter.replace(norm.outputs[0], normed)
    return rewriter.finish(), True


FUSE_ADD_RMS_NORM = Pass("fuse_add_rms_norm", fuse_add_rms_norm, "residual add + RMSNorm → add_rms_norm")
