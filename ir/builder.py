"""Build graphs node by node; each node's output types come from its op's rule."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kiln.ir.errors import IRError
from kiln.ir.graph import Graph, Node, Value, ValueKind
from kiln.ir.ops import ShapeError, get_op
from kiln.ir.types import TensorType


class GraphBuilder:
    def __init__(self, name: str, first_id: int = 0) -> None:
        """`first_id`: the number the first node output is named after (%first_id, then upwards)."""
        self.name = name
        self._inputs: list[Value] = []
        self._params: dict[str, Value] = {}
        self._nodes: list[Node] = []
        self.next_id = first_id

    def input(self, name: str, type_: TensorType) -> Value:
        value = Value(name, type_, ValueKind.INPUT)
        self._inputs.append(value)
        return value

    def param(self, name: str, type_: TensorType) -> Value:
        """The parameter called `name`; asking twice (tied weights) returns the same value."""
        existing = self._params.get(name)
        if existing is not None:
            if existing.type != type_:
                raise IRError(f"param {name} declared as {existing.type.text()} and {type_.text()}")
            return existing
        value = Value(name, type_, ValueKind.PARAM)
        self._params[name] = value
        return value

    def op(
        self,
        op_name: str,
        inputs: Sequence[Value | None],
        attrs: dict[str, Any] | None = None,
        source: str | None = None,
    ) -> list[Value]:
        op = get_op(op_name)
        attrs = {key: value for key, value in (attrs or {}).items() if value is not None}  # None = default
        where = f"{op_name}{' (from ' + source + ')' if source else ''}"
        try:
            out_types = op.infer([v.type if v is not None else None for v in inputs], attrs)
        except ShapeError as err:
            raise IRError(f"{where}: {err}") from None
        outputs = []
        for type_ in out_types:
            outputs.append(Value(str(self.next_id), type_, ValueKind.NODE))
            self.next_id += 1
        self._nodes.append(Node(op_name, tuple(inputs), tuple(outputs), attrs, source))
        return outputs

    def op1(self, op_name: str, inputs: Sequence[Value | None], **kwargs: Any) -> Value:
        """`op` for single-output ops."""
        (out,) = self.op(op_name, inputs, **kwargs)
        return out

    def build(self, outputs: Sequence[Value]) -> Graph:
        return Graph(
            self.name, list(self._inputs), list(self._params.values()), list(self._nodes), list(outputs)
        )
