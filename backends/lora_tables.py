"""A step's LoRA tables (ir/step.py LORA_*): which modules it adapts and their shapes, from the graph at
compile and from a backend's manifest entry (`lora` in step.json, onnx.json) at load; allocating them
where the executable reads them, and the inputs of a step that uses none."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.ir import Graph
from kiln.ir.host_arrays import HOST_DTYPES
from kiln.ir.step import LORA_A_PREFIX, LORA_B_PREFIX, LORA_SLOTS_INPUT, StepInputs

LoRATables = dict[str, Any]  # input name -> a numpy array on the host, a torch tensor on a GPU


@dataclass(frozen=True)
class LoRAModule:
    """One adapted module kind (q_proj, ...): its tables hold `layers` rows of in -> out updates."""

    name: str
    layers: int
    in_features: int
    out_features: int


@dataclass(frozen=True)
class LoRASpec:
    modules: tuple[LoRAModule, ...]
    dtype: str  # the IR dtype of the tables (the activations')

    @classmethod
    def of_graph(cls, graph: Graph) -> LoRASpec | None:
        """The tables `graph`'s step takes, None for a step without LoRA."""
        if not any(value.name == LORA_SLOTS_INPUT for value in graph.inputs):
            return None
        modules, dtypes = [], set()
        for value in graph.inputs:
            if value.name.startswith(LORA_A_PREFIX):
                name = value.name[len(LORA_A_PREFIX) :]
                out_features = graph.input(LORA_B_PREFIX + name).type.shape[3]
                layers, _, _, in_features = value.type.shape
                modules.append(LoRAModule(name, int(layers), int(in_features), int(out_features)))
                dtypes.add(value.type.dtype)
        (dtype,) = dtypes
        return cls(tuple(modules), dtype)

    def fields(self) -> dict[str, Any]:
        """The manifest entry."""
        return {
            "dtype": self.dtype,
            "modules": [[m.name, m.layers, m.in_features, m.out_features] for m in self.modules],
        }

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any] | None) -> LoRASpec | None:
        if not fields:
            return None
        modules = tuple(
            LoRAModule(str(n), int(layers), int(i), int(o)) for n, layers, i, o in fields["modules"]
        )
        return cls(modules, str(fields["dtype"]))

    def module(self, name: str) -> LoRAModule | None:
        return next((m for m in self.modules if m.name == name), None)

    def table_shapes(self, slots: int, rank: int) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for m in self.modules:
            shapes[LORA_A_PREFIX + m.name] = (m.layers, slots, rank, m.in_features)
            shapes[LORA_B_PREFIX + m.name] = (m.layers, slots, rank, m.out_features)
        return shapes

    def allocate(self, slots: int, rank: int, device: str = "cpu") -> LoRATables:
        """Zeroed tables for `slots` adapters of rank up to `rank`, where `device` reads them."""
        shapes = self.table_shapes(slots, rank)
        if str(device).split(":")[0] != "cpu":
            import torch

            from kiln.ir.types import DTYPES

            return {
                name: torch.zeros(shape, dtype=DTYPES[self.dtype], device=device)
                for name, shape in shapes.items()
            }
        return {name: np.zeros(shape, HOST_DTYPES[self.dtype]) for name, shape in shapes.items()}

    def table_bytes(self, slots: int, rank: int) -> int:
        size = np.dtype(HOST_DTYPES[self.dtype]).itemsize
        return sum(int(np.prod(shape)) * size for shape in self.table_shapes(slots, rank).values())


def lora_fields(graph: Graph) -> dict[str, Any] | None:
    """A backend manifest's `lora` entry: the LoRA tables the step takes, None for a step without."""
    spec = LoRASpec.of_graph(graph)
    return spec.fields() if spec is not None else None


def with_lora_inputs(inputs: StepInputs, spec: LoRASpec, empty_tables: LoRATables) -> StepInputs:
    """`inputs` with what a step compiled with LoRA takes where the caller gave none: every row on the
    base model (slot -1) and `empty_tables` (no slots)."""
    if inputs.lora_slots is not None and inputs.lora_tables:
        return inputs
    from dataclasses import replace

    slots = (
        inputs.lora_slots if inputs.lora_slots is not None else np.full(len(inputs.token_ids), -1, np.int64)
    )
    return replace(inputs, lora_slots=slots, lora_tables=inputs.lora_tables or empty_tables)


def lora_spec(executable: Any) -> LoRASpec | None:
    """The LoRA tables an executable's step takes (its `lora_spec`), None where it takes none."""
    return getattr(executable, "lora_spec", None)
