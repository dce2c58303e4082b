"""The IR graph: SSA values, nodes in order, graph inputs, named weight parameters, outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kiln.ir.types import TensorType

AttrValue = int | float | str | bool | None | list[Any]


class ValueKind(Enum):
    INPUT = "input"  # a step input, bound per call
    PARAM = "param"  # a named weight held outside the graph (safetensors)
    NODE = "node"  # produced by a node


@dataclass(frozen=True)
class Value:
    name: str
    type: TensorType
    kind: ValueKind

    def ref(self) -> str:
        return f"@{self.name}" if self.kind is ValueKind.PARAM else f"%{self.name}"


@dataclass(frozen=True)
class Node:
    """One op application. `inputs` may hold None for an absent optional input (a linear's bias)."""

    op: str
    inputs: tuple[Value | None, ...]
    outputs: tuple[Value, ...]
    attrs: dict[str, AttrValue] = field(default_factory=dict)
    source: str | None = None  # the model source line this node came from, for error messages

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    def describe(self) -> str:
        where = f" (from {self.source})" if self.source else ""
        outs = ", ".join(v.ref() for v in self.outputs)
        ins = ", ".join(v.ref() if v else "none" for v in self.inputs)
        return f"{outs} = {self.op}({ins}){where}"


@dataclass
class Graph:
    name: str
    inputs: list[Value]
    params: list[Value]
    nodes: list[Node]
    outputs: list[Value]

    def param(self, name: str) -> Value:
        for value in self.params:
            if value.name == name:
                return value
        raise KeyError(name)

    def input(self, name: str) -> Value:
        for value in self.inputs:
            if value.name == name:
                return value
        raise KeyError(name)

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for node in self.nodes:
            counts[node.op] = counts.get(node.op, 0) + 1
        return counts

    def users(self) -> dict[str, list[Node]]:
        """Value name → nodes that read it."""
        result: dict[str, list[Node]] = {}
        for node in self.nodes:
            for value in node.inputs:
                if value is not None:
                    result.setdefault(value.name, []).append(node)
        return result
