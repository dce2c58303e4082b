"""Linears that read the same input become one linear over concatenated weights and a split:
Q, K and V projections into one (with their biases), gate and up projections into one. Quantized
linears of one layout fuse the same way (their rows concatenate)."""

from __future__ import annotations

from kiln.ir import Node, Program, Value, ValueKind
from kiln.ir.deferred import concatenated
from kiln.passes.base import Pass, PassOptions
from kiln.passes.rewriter import Rewriter

_FUSIBLE = ("linear", "quantized_linear")


def _common_prefix(names: list[str]) -> str:
    length = 0
    while all(len(n) > length and n[length] == names[0][length] for n in names):
        length += 1
    return names[0][:length]


def _fused_name(names: list[str]) -> str:
    """model.layers.0.self_attn.{q,k,v}_proj.weight → model.layers.0.self_attn.qkv_proj.weight."""
    prefix = _common_prefix(names)
    prefix = prefix[: prefix.rfind(".") + 1]
    reversed_suffix = _common_prefix([n[::-1] for n in names])[::-1]
    suffix = reversed_suffix[reversed_suffix.find("_") :] if "_" in reversed_suffix else reversed_suffix
    parts = [n[len(prefix) : len(n) - len(suffix)] for n in names]
    joined = "".join(parts) if all(len(p) == 1 for p in parts) else "_".join(parts)
    return f"{prefix}{joined}{suffix}"


def _signature(node: Node) -> tuple | None:
    """Nodes with equal signatures can fuse: same op, input, layout and which optional inputs exist."""
    if node.op not in _FUSIBLE or any(
        v is not None and v.kind is not ValueKind.PARAM for v in node.inputs[1:]
    ):
        return None
    x = node.inputs[0]
    assert x is not None
    present = tuple(v is not None for v in node.inputs[1:])
    return (node.op, x.name, present, tuple(sorted(node.attrs.items())))


def _groups(program: Program) -> dict[tuple, list[Node]]:
    groups: dict[tuple, list[Node]] = {}
    for node in program.graph.nodes:
        signature = _signature(node)
        if signature is not None:
            groups.setdefault(signature, []).append(node)
    return {key: nodes for key, nodes in groups.items() if len(nodes) > 1}


def fuse_parallel_linears(program: Program, options: PassOptions) -> tuple[Program, bool]:
    groups = _groups(program)
    if not groups:
        return program, False
    first_of = {id(nodes[0]): nodes for nodes in groups.values()}
    fused_away = {id(node) for nodes in groups.values() for node in nodes[1:]}
    rewriter = Rewriter(program)
    for node in program.graph.nodes:
        if id(node) in fused_away:
            continue
        members = first_of.get(id(node))
        if members is None:
            rewriter.keep(node)
            continue
        inputs: list[Value | None] = [node.inputs[0]]
        for position in range(1, len(node.inputs)):
            params = [member.inputs[position] for member in members]
            if params[0] is None:
                inputs.append(None)
                continue
            names = [p.name for p in params if p is not None]
            tensor = concatenated([rewriter.weights[name] for name in names])
            inputs.append(rewriter.add_param(_fused_name(names), tensor))
        (fused,) = rewriter.emit(node.op, inputs, node.attrs, node.source)
        sizes = [int(member.outputs[0].type.shape[-1]) for member in members]
        pieces = rewriter.emit("split", [fused], {"sizes": sizes}, node.source)
        for member, piece in zip(members, pieces, strict=True):
            rewriter.replace(member.outputs[0], piece)
    return rewriter.finish(), True


FUSE_PARALLEL_LINEARS = Pass(
    "fuse_parallel_linears", fuse_parallel_linears, "one matmul for linears sharing an input (QKV, gate/up)"
)
