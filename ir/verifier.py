"""The verifier: every value defined once before use, every node fits its op's rule."""

from __future__ import annotations

from kiln.ir.errors import IRError
from kiln.ir.graph import Graph, Node, Value, ValueKind
from kiln.ir.ops import REGISTRY, ShapeError


def _fail(node: Node, message: str) -> IRError:
    return IRError(f"invalid node `{node.describe()}`: {message}")


def _check_inputs(node: Node, defined: dict[str, Value]) -> None:
    for value in node.inputs:
        if value is None:
            continue
        known = defined.get(value.name)
        if known is None:
            raise _fail(node, f"{value.ref()} is used before it is defined")
        if known != value:
            raise _fail(
                node, f"{value.ref()} is used as {value.type.text()} but defined as {known.type.text()}"
            )


def _check_op(node: Node) -> None:
    op = REGISTRY.get(node.op)
    if op is None:
        raise _fail(node, f"unknown op {node.op!r}")
    low, high = op.num_inputs
    if not low <= len(node.inputs) <= high:
        raise _fail(node, f"{node.op} takes {low}..{high} inputs, got {len(node.inputs)}")
    missing = [i for i in range(low) if node.inputs[i] is None]
    if missing:
        raise _fail(node, f"required input {missing[0]} is none")
    unknown = sorted(set(node.attrs) - set(op.attrs))
    if unknown:
        raise _fail(node, f"unknown attributes {unknown}; {node.op} takes {sorted(op.attrs)}")
    try:
        expected = op.infer([v.type if v is not None else None for v in node.inputs], node.attrs)
    except ShapeError as err:
        raise _fail(node, str(err)) from None
    actual = [v.type for v in node.outputs]
    if expected != actual:
        want = ", ".join(t.text() for t in expected)
        got = ", ".join(t.text() for t in actual)
        raise _fail(node, f"outputs are typed {got} but {node.op} gives {want}")


def verify(graph: Graph) -> None:
    """Raise IRError naming the first node that breaks a rule."""
    defined: dict[str, Value] = {}
    for value in [*graph.inputs, *graph.params]:
        expected_kind = ValueKind.INPUT if value in graph.inputs else ValueKind.PARAM
        if value.kind is not expected_kind:
            raise IRError(f"{value.ref()} is listed as a {expected_kind.value} but is a {value.kind.value}")
        if value.name in defined:
            raise IRError(f"{value.ref()} is defined twice")
        defined[value.name] = value
    for node in graph.nodes:
        _check_inputs(node, defined)
        _check_op(node)
        for value in node.outputs:
            if value.kind is not ValueKind.NODE:
                raise _fail(node, f"output {value.ref()} is not a node value")
            if value.name in defined:
                raise _fail(node, f"{value.ref()} is defined twice")
            defined[value.name] = value
    for value in graph.outputs:
        if defined.get(value.name) != value:
            raise IRError(f"graph output {value.ref()} is not defined")
