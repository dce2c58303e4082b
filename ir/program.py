"""A program: a graph and the weights its params name. Passes rewrite both together."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.ir.deferred import Weight
from kiln.ir.errors import IRError
from kiln.ir.graph import Graph
from kiln.ir.types import TensorType
from kiln.ir.verifier import verify


def weight_type(tensor: torch.Tensor) -> TensorType:
    return TensorType.of(tensor)


@dataclass
class Program:
    graph: Graph
    weights: dict[str, Weight]

    def verify(self) -> None:
        """The graph verifies, and every param has a weight of its storage type (and no weight is extra)."""
        verify(self.graph)
        names = {param.name for param in self.graph.params}
        for param in self.graph.params:
            tensor = self.weights.get(param.name)
            if tensor is None:
                raise IRError(f"param @{param.name} has no weight")
            stored = weight_type(tensor)
            if (stored.dtype, stored.shape) != (param.type.dtype, param.type.shape):
                raise IRError(f"weight @{param.name} is {stored.text()}, the graph says {param.type.text()}")
        extra = sorted(set(self.weights) - names)
        if extra:
            raise IRError(f"weights {extra[:3]} are not params of the graph")

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weights.values())
