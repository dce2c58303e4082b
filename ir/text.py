"""The text form: `print_graph` and `parse_graph` round-trip exactly.

    graph NAME(%token_ids: i64[T], ...) {
      param @model.norm.weight: f32[576]
      %0: f32[T,576] = embedding(@model.embed_tokens.weight, %token_ids)
      %7: f32[T,576] = rms_norm(%6, @model.norm.weight) {"eps": 1e-05}  # "llama.py:61"
      return %9
    }

Attributes are a JSON object; the trailing comment is the JSON-quoted source line.
"""

from __future__ import annotations

import json
import re

from kiln.ir.errors import IRError
from kiln.ir.graph import Graph, Node, Value, ValueKind
from kiln.ir.types import TensorType

_TYPE = r"\w+\[[^\]]*\](?:\{[^}]*\})?"
_DECL = re.compile(rf"%([\w.]+): ({_TYPE})")
_HEADER = re.compile(r"graph ([\w.\-]+)\((.*)\) \{")
_PARAM = re.compile(rf"param @([\w.\-]+): ({_TYPE})")
_NODE = re.compile(r"(?P<outs>.+?) = (?P<op>\w+)\((?P<args>[^)]*)\)(?P<rest>.*)")


def _node_line(node: Node) -> str:
    outs = ", ".join(f"{v.ref()}: {v.type.text()}" for v in node.outputs)
    args = ", ".join(v.ref() if v is not None else "none" for v in node.inputs)
    line = f"  {outs} = {node.op}({args})"
    if node.attrs:
        line += " " + json.dumps(node.attrs, sort_keys=True)
    if node.source:
        line += "  # " + json.dumps(node.source)
    return line


def print_graph(graph: Graph) -> str:
    inputs = ", ".join(f"{v.ref()}: {v.type.text()}" for v in graph.inputs)
    lines = [f"graph {graph.name}({inputs}) {{"]
    lines += [f"  param {v.ref()}: {v.type.text()}" for v in graph.params]
    lines += [_node_line(node) for node in graph.nodes]
    lines.append(f"  return {', '.join(v.ref() for v in graph.outputs)}")
    lines.append("}")
    return "\n".join(lines) + "\n"


class _Parser:
    def __init__(self) -> None:
        self.values: dict[str, Value] = {}

    def lookup(self, ref: str, line_no: int) -> Value | None:
        if ref == "none":
            return None
        value = self.values.get(ref)
        if value is None:
            raise IRError(f"line {line_no}: {ref} is not defined")
        return value

    def define(self, value: Value) -> Value:
        self.values[value.ref()] = value
        return value

    def node(self, text: str, line_no: int) -> Node:
        match = _NODE.fullmatch(text)
        if not match:
            raise IRError(f"line {line_no}: cannot parse node {text!r}")
        outs = [
            Value(name, TensorType.parse(type_text), ValueKind.NODE)
            for name, type_text in _DECL.findall(match["outs"])
        ]
        args = [a.strip() for a in match["args"].split(",") if a.strip()]
        inputs = tuple(self.lookup(arg, line_no) for arg in args)
        attrs, source = self.trailer(match["rest"].strip(), line_no)
        for value in outs:
            self.define(value)
        return Node(match["op"], inputs, tuple(outs), attrs, source)

    @staticmethod
    def trailer(rest: str, line_no: int) -> tuple[dict, str | None]:
        attrs: dict = {}
        try:
            if rest.startswith("{"):
                attrs, end = json.JSONDecoder().raw_decode(rest)
                rest = rest[end:].strip()
            source = json.loads(rest[1:].strip()) if rest.startswith("#") else None
        except json.JSONDecodeError as err:
            raise IRError(f"line {line_no}: bad attributes or source: {err}") from None
        if rest and not rest.startswith("#"):
            raise IRError(f"line {line_no}: unexpected text {rest!r}")
        return attrs, source


def parse_graph(text: str) -> Graph:
    lines = [(i + 1, line.strip()) for i, line in enumerate(text.splitlines()) if line.strip()]
    if not lines:
        raise IRError("empty graph text")
    header = _HEADER.fullmatch(lines[0][1])
    if not header:
        raise IRError(f"line {lines[0][0]}: expected `graph NAME(...) {{`")
    parser = _Parser()
    inputs = [
        parser.define(Value(name, TensorType.parse(t), ValueKind.INPUT))
        for name, t in _DECL.findall(header[2])
    ]
    params: list[Value] = []
    nodes: list[Node] = []
    outputs: list[Value] = []
    for line_no, line in lines[1:]:
        if line == "}":
            return Graph(header[1], inputs, params, nodes, outputs)
        if param := _PARAM.fullmatch(line):
            params.append(parser.define(Value(param[1], TensorType.parse(param[2]), ValueKind.PARAM)))
        elif line.startswith("return"):
            refs = [r.strip() for r in line.removeprefix("return").split(",") if r.strip()]
            outputs = [v for v in (parser.lookup(r, line_no) for r in refs) if v is not None]
        else:
            nodes.append(parser.node(line, line_no))
    raise IRError("graph text has no closing `}`")


def structural_equal(a: Graph, b: Graph) -> bool:
    """Same inputs, params, ops, attributes and dataflow; node value names may differ."""
    if [(v.name, v.type) for v in a.inputs] != [(v.name, v.type) for v in b.inputs]:
        return False
    if [(v.name, v.type) for v in a.params] != [(v.name, v.type) for v in b.params]:
        return False
    if len(a.nodes) != len(b.nodes):
        return False
    renamed: dict[str, str] = {v.ref(): v.ref() for v in [*a.inputs, *a.params]}
    for na, nb in zip(a.nodes, b.nodes, strict=True):
        if (na.op, na.attrs, len(na.inputs), len(na.outputs)) != (
            nb.op,
            nb.attrs,
            len(nb.inputs),
            len(nb.outputs),
        ):
            return False
        for va, vb in zip(na.inputs, nb.inputs, strict=True):
            if (va is None) != (vb is None) or (va is not None and renamed.get(va.ref()) != vb.ref()):
                return False
        for va, vb in zip(na.outputs, nb.outputs, strict=True):
            if va.type != vb.type:
                return False
            renamed[va.ref()] = vb.ref()
    return [renamed.get(v.ref()) for v in a.outputs] == [v.ref() for v in b.outputs]
