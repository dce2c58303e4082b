"""What one lowering run shares between op rules: the ONNX builder, names, weight bindings, caches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kiln.backends.onnx.builder import OnnxBuilder
from kiln.backends.onnx.weights import WeightBinding
from kiln.ir import Graph, Value, ValueKind

T = TypeVar("T")


@dataclass(frozen=True)
class LoweringOptions:
    contrib_ops: bool = True  # com.microsoft ops (MatMulNBits) for ONNX Runtime; False: standard ONNX only
    opset: int = 21


class LoweringContext:
    def __init__(self, graph: Graph, weights: dict[str, torch.Tensor], options: LoweringOptions) -> None:
        self.graph = graph
        self.weights = weights  # read for dtypes, shapes and layout decisions only
        self.options = options
        self.b = OnnxBuilder()
        self.bindings: dict[str, WeightBinding] = {}
        self.kv_outputs: dict[int, tuple[str, str]] = {}  # layer → (new k, new v) [T, KVH, D]
        self._cache: dict[Any, Any] = {}

    def name(self, value: Value) -> str:
        """The ONNX name of an IR value: inputs and params keep theirs, node outputs become v<name>."""
        if value.kind is ValueKind.PARAM:
            return self.bind_param(value)
        return value.name if value.kind is ValueKind.INPUT else f"v{value.name}"

    def bind_param(self, value: Value) -> str:
        if value.name not in self.bindings:
            shape = [int(d) for d in value.type.shape]
            self.bindings[value.name] = WeightBinding(
                value.name, "param", [value.name], value.type.dtype, shape
            )
        return value.name

    def bind(self, binding: WeightBinding) -> str:
        self.bindings.setdefault(binding.name, binding)
        return binding.name

    def cached(self, key: Any, make: Callable[[], T]) -> T:
        """Build once per graph what several nodes share (the attention indices, rope tables)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]


__all__ = ["LoweringContext", "LoweringOptions"]
