"""The text form: golden output, exact round trips, structural equality, parse errors."""

from __future__ import annotations

import pytest

from kiln.ir import GraphBuilder, IRError, QuantLayout, TensorType, parse_graph, print_graph, structural_equal

GOLDEN = """\
graph tiny(%x: f32[T,8], %ids: i64[B]) {
  param @w: f32[4,8]
  param @q: f32[4,8]{q4/g32/min/gguf_q4_1}
  param @n: f32[8]
  %0: f32[T,8] = rms_norm(%x, @n) {"eps": 1e-06}  # "model.py:3 y = norm(x)"
  %1: f32[T,4] = linear(%0, @w)
  %2: f32[T,2,2] = reshape(%1) {"shape": [-1, 2, 2]}
  %3: f32[B,4] = take_rows(%1, %ids)
  return %3
}
"""


def _tiny():
    b = GraphBuilder("tiny")
    x = b.input("x", TensorType("f32", ("T", 8)))
    ids = b.input("ids", TensorType("i64", ("B",)))
    w = b.param("w", TensorType("f32", (4, 8)))
    b.param("q", TensorType("f32", (4, 8), QuantLayout(4, 32, "min", "gguf_q4_1")))
    n = b.param("n", TensorType("f32", (8,)))
    h = b.op1("rms_norm", [x, n], attrs={"eps": 1e-6}, source="model.py:3 y = norm(x)")
    y = b.op1("linear", [h, w])
    b.op1("reshape", [y], attrs={"shape": [-1, 2, 2]})
    return b.build([b.op1("take_rows", [y, ids])])


def test_golden_text() -> None:
    assert print_graph(_tiny()) == GOLDEN


def test_parse_gives_an_equal_graph() -> None:
    parsed = parse_graph(GOLDEN)
    assert print_graph(parsed) == GOLDEN
    assert structural_equal(parsed, _tiny())


def test_structural_equal_ignores_value_names_but_not_dataflow() -> None:
    renamed = parse_graph(GOLDEN.replace("%3", "%30").replace("%1", "%10"))
    assert structural_equal(renamed, _tiny())
    rewired = parse_graph(
        GOLDEN.replace("take_rows(%1, %ids)", "take_rows(%0, %ids)").replace("f32[B,4]", "f32[B,8]")
    )
    assert not structural_equal(rewired, _tiny())
    other_attr = parse_graph(GOLDEN.replace('"eps": 1e-06', '"eps": 1e-05'))
    assert not structural_equal(other_attr, _tiny())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty graph"),
        ("graph g() {\n  return %9\n}\n", "%9 is not defined"),
        ("graph g(%x: f32[2]) {\n  %0: f32[2] = silu(%x) {bad json}\n}\n", "bad attributes"),
        ("graph g(%x: f32[2]) {\n  return %x\n", "no closing"),
    ],
)
def test_parse_errors_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(IRError, match=message):
        parse_graph(text)


def test_captured_smollm2_round_trips(smollm2_built) -> None:
    text = print_graph(smollm2_built.captured.graph)
    parsed = parse_graph(text)
    assert print_graph(parsed) == text
    assert structural_equal(parsed, smollm2_built.captured.graph)
    assert smollm2_built.captured.graph.op_counts()["paged_attention"] == 30
