"""Memory planning: each activation's lifetime, a buffer reuse plan backends may follow, and the peak
activation bytes of a step for given sizes of the symbolic dims."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.ir import DTYPES, Graph, ValueKind


@dataclass(frozen=True)
class MemoryPlan:
    buffer_bytes: list[int]  # the buffers to allocate, in bytes
    assignment: dict[str, int]  # activation value name → buffer index
    peak_live_bytes: int  # most bytes of activations alive at once (the lower bound of any plan)

    @property
    def planned_bytes(self) -> int:
        return sum(self.buffer_bytes)


def value_bytes(shape: tuple, dtype: str, sizes: dict[str, int]) -> int:
    count = 1
    for dim in shape:
        count *= dim if isinstance(dim, int) else sizes[dim]
    return count * torch.empty((), dtype=DTYPES[dtype]).element_size()


def plan_memory(graph: Graph, sizes: dict[str, int]) -> MemoryPlan:
    """Greedy best fit: an output takes the smallest free buffer that holds it, else a new buffer;
    a buffer is freed after the last node that reads its value. `sizes` binds the symbolic dims."""
    last_use: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        for value in node.inputs:
            if value is not None and value.kind is ValueKind.NODE:
                last_use[value.name] = index
    for value in graph.outputs:
        last_use[value.name] = len(graph.nodes)
    buffers: list[int] = []
    free: list[int] = []
    assignment: dict[str, int] = {}
    live = peak = 0
    released: set[str] = set()
    for index, node in enumerate(graph.nodes):
        for value in node.outputs:
            need = value_bytes(value.type.shape, value.type.dtype, sizes)
            fitting = sorted((buffers[b], b) for b in free if buffers[b] >= need)
            if fitting:
                buffer = fitting[0][1]
                free.remove(buffer)
            else:
                buffer = len(buffers)
                buffers.append(need)
            assignment[value.name] = buffer
            live += need
        peak = max(peak, live)
        for value in [*node.inputs, *node.outputs]:
            if value is None or value.name not in assignment or value.name in released:
                continue
            if last_use.get(value.name, index) <= index:
                released.add(value.name)
                free.append(assignment[value.name])
                live -= value_bytes(value.type.shape, value.type.dtype, sizes)
    return MemoryPlan(buffers, assignment, peak)
