"""The verifier names the node that breaks a rule."""

from __future__ import annotations

import dataclasses

import pytest

from kiln.ir import GraphBuilder, IRError, TensorType, Value, ValueKind, parse_graph, verify


def _graph():
    b = GraphBuilder("g")
    x = b.input("x", TensorType("f32", ("T", 8)))
    w = b.param("w", TensorType("f32", (4, 8)))
    return b.build([b.op1("silu", [b.op1("linear", [x, w], source="m.py:9 y = proj(x)")])])


def test_a_valid_graph_passes() -> None:
    verify(_graph())


def test_wrong_output_shape_is_rejected_naming_the_node() -> None:
    graph = _graph()
    node = graph.nodes[0]
    bad_out = Value(node.outputs[0].name, TensorType("f32", ("T", 5)), ValueKind.NODE)
    graph.nodes[0] = dataclasses.replace(node, outputs=(bad_out,))
    with pytest.raises(
        IRError, match=r"invalid node `%0 = linear\(%x, @w\) \(from m.py:9 y = proj\(x\)\)`.*f32\[T,5\]"
    ):
        verify(graph)


def test_wrong_input_shape_in_text_is_rejected() -> None:
    text = """\
graph g(%x: f32[T,7]) {
  param @w: f32[4,8]
  %0: f32[T,4] = linear(%x, @w)
  return %0
}
"""
    with pytest.raises(IRError, match=r"linear\(%x, @w\).*does not fit weight"):
        verify(parse_graph(text))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("%0: f32[T,8] = nosuchop(%x)", "unknown op 'nosuchop'"),
        ("%0: f32[T,8] = silu(%x, %x)", "takes 1..1 inputs"),
        ('%0: f32[T,8] = silu(%x) {"eps": 1}', "unknown attributes"),
        ("%0: i64[T,8] = silu(%x)", "outputs are typed i64"),
    ],
)
def test_each_rule(line: str, message: str) -> None:
    with pytest.raises(IRError, match=message):
        verify(parse_graph(f"graph g(%x: f32[T,8]) {{\n  {line}\n  return %0\n}}\n"))


def test_use_before_definition() -> None:
    graph = _graph()
    graph.nodes.reverse()
    with pytest.raises(IRError, match="used before it is defined"):
        verify(graph)


def test_builder_refuses_a_node_that_does_not_fit() -> None:
    b = GraphBuilder("g")
    x = b.input("x", TensorType("f32", ("T", 8)))
    w = b.param("w", TensorType("f32", (4, 9)))
    with pytest.raises(IRError, match=r"linear \(from here.py:1\): x \[T,8\] does not fit weight \[4,9\]"):
        b.op("linear", [x, w], source="here.py:1")
