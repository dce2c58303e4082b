"""A step's LoRA tables (ir/step.py LORA_*): which modules it adapts and their shapes, from its
signature; allocating them where the executable reads them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.ir.host_arrays import HOST_DTYPES
from kiln.ir.step import LORA_A_PREFIX, LORA_B_PREFIX, LORA_SLOTS_INPUT, StepSignature

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
    def of_signature(cls, signature: StepSignature) -> LoRASpec | None:
        """The tables `signature`'s step takes, None for a step without LoRA."""
        if not signature.takes(LORA_SLOTS_INPUT):
            return None
        types = signature.types
        modules, dtypes = [], set()
        for name, tensor_type in signature.inputs:
            if name.startswith(LORA_A_PREFIX):
                module = name[len(LORA_A_PREFIX) :]
                out_features = types[LORA_B_PREFIX + module].shape[3]
                layers, _, _, in_features = tensor_type.shape
                modules.append(LoRAModule(module, int(layers), int(in_features), int(out_features)))
                dtypes.add(tensor_type.dtype)
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
