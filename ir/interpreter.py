"""Run a graph with each op's torch reference (ir/ops), node by node on the CPU: the semantics every
backend and pass is checked against, run by the reference backend and by calibrating passes."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from kiln.ir.deferred import materialize
from kiln.ir.errors import IRError
from kiln.ir.graph import Graph
from kiln.ir.host_arrays import as_torch
from kiln.ir.ops import get_op
from kiln.ir.types import DTYPES, Dim, TensorType


def _bind(expected: TensorType, tensor: torch.Tensor, name: str, symbols: dict[str, int]) -> None:
    """Check `tensor` against `expected`, binding each symbolic dim the first time it is seen."""
    if tensor.dtype != DTYPES[expected.dtype] or tensor.dim() != expected.rank:
        raise IRError(
            f"input {name} is {tensor.dtype} with shape {list(tensor.shape)}, expected {expected.text()}"
        )
    for dim, size in zip(expected.shape, tensor.shape, strict=True):
        bound: Dim = symbols.setdefault(dim, size) if isinstance(dim, str) else dim
        if bound != size:
            raise IRError(
                f"input {name} has shape {list(tensor.shape)}, which does not fit {expected.text()} "
                f"(dim {dim} is {bound} elsewhere)"
            )


def check_weights(graph: Graph, weights: dict[str, torch.Tensor]) -> None:
    for param in graph.params:
        weight = weights.get(param.name)
        if weight is None:
            raise IRError(f"no weight for param @{param.name}")
        given = TensorType.of(weight)
        if given != TensorType(param.type.dtype, param.type.shape):
            raise IRError(f"weight @{param.name} is {given.text()}, graph says {param.type.text()}")


def last_uses(graph: Graph) -> dict[int, list[str]]:
    """Node index → names of values no later node reads, so they can be dropped there."""
    last: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        for value in node.inputs:
            if value is not None:
                last[value.name] = index
    kept = {v.name for v in graph.outputs} | {v.name for v in graph.params} | {v.name for v in graph.inputs}
    by_index: dict[int, list[str]] = {}
    for name, index in last.items():
        if name not in kept:
            by_index.setdefault(index, []).append(name)
    return by_index


def interpret(
    graph: Graph,
    weights: dict[str, torch.Tensor],
    inputs: Mapping[str, torch.Tensor | np.ndarray],
    drops: dict[int, list[str]] | None = None,
) -> list[torch.Tensor]:
    """Run `graph` on `inputs` (by input name; numpy arrays are shared, not copied); the graph's outputs
    in order. `drops`: `last_uses(graph)`, for a caller that runs the graph many times."""
    symbols: dict[str, int] = {}
    env: dict[str, torch.Tensor] = {name: materialize(weight) for name, weight in weights.items()}
    for value in graph.inputs:
        if value.name not in inputs:
            raise IRError(f"no tensor for graph input %{value.name}")
        given = inputs[value.name]
        given = as_torch(given) if isinstance(given, np.ndarray) else given
        _bind(value.type, given, value.name, symbols)
        env[value.name] = given
    drops = drops if drops is not None else last_uses(graph)
    with torch.no_grad():
        for index, node in enumerate(graph.nodes):
            args = [env[v.name] if v is not None else None for v in node.inputs]
            result = get_op(node.op).reference(*args, **node.attrs)
            results = result if isinstance(result, tuple) else (result,)
            for value, tensor in zip(node.outputs, results, strict=True):
                env[value.name] = tensor
            for name in drops.get(index, ()):
                del env[name]
    return [env[v.name] for v in graph.outputs]
