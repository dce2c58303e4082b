"""LoRA adapters at run time: the adapters a server knows (registered by name, read once and kept on the
host) and the `max_loras` slots of the step's tables (backends/lora_tables.py) that hold the ones in use.

A sequence takes its adapter's slot when the scheduler admits it and gives it back when it stops running
(finished, aborted or preempted). An adapter not in a slot is copied into a free one, or into the least
recently used slot no running sequence holds; with every slot held, the sequence waits. Nothing is
recompiled: loading an adapter writes its rows of the tables."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.backends.lora_tables import LoRASpec, LoRATables
from kiln.errors import KilnError
from kiln.ir.adapters import AdapterWeights

AdapterReader = Callable[
    [str], AdapterWeights
]  # a path -> its adapter (the frontend's, wired in by the caller)
DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 16


class LoRAError(KilnError):
    """An adapter that cannot be loaded, served or unloaded; the message says which and why."""


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: the adapter's name (what a request's `model` names), a unique positive id, and its path
    (a PEFT folder or a llama.cpp LoRA .gguf)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = DEFAULT_MAX_LORAS  # adapters one step can use (the tables' slots)
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")


@dataclass
class Adapter:
    request: LoRARequest
    weights: AdapterWeights
    cache_salt: str  # what the prefix cache keys its blocks by: the adapter's content, so blocks persist
    slot: int | None = None


@dataclass
class _Slot:
    adapter: str | None = None
    holders: int = 0  # running sequences
    last_used: int = 0


@dataclass
class AdapterSlots:
    """The registered adapters and the slots of `tables` (allocated by the caller where the step reads
    them: host arrays on a CPU, torch tensors on a GPU)."""

    spec: LoRASpec
    config: LoRAConfig
    tables: LoRATables
    reader: AdapterReader
    adapters: dict[str, Adapter] = field(default_factory=dict)
    requests_by_adapter: Counter[str] = field(default_factory=Counter)
    _slots: list[_Slot] = field(init=False)
    _clock: count[int] = field(default_factory=count)

    def __post_init__(self) -> None:
        self._slots = [_Slot() for _ in range(self.config.max_loras)]

    # -- registering -------------------------------------------------------------------------------

    def register(self, request: LoRARequest) -> Adapter:
        """The adapter of `request`: the one registered under its name, or read, checked and registered
        now; a LoRAError names what is wrong with it."""
        known = self._known(request)
        return known if known is not None else self.add(self.read(request))

    def read(self, request: LoRARequest) -> Adapter:
        """Read and check the adapter of `request` without registering it (any thread may)."""
        if not request.lora_name:
            raise LoRAError("an adapter needs a name (lora_name)")
        try:
            weights = self.reader(request.lora_path)
        except KilnError as error:
            raise LoRAError(str(error), hint=error.hint) from None
        self._check(request.lora_name, weights)
        return Adapter(request, weights, f"lora:{weights.digest()}")

    def add(self, adapter: Adapter) -> Adapter:
        """Register an adapter `read` made (on the engine's thread); the one of its name where the same
        request registered it meanwhile."""
        known = self._known(adapter.request)
        if known is not None:
            return known
        self.adapters[adapter.request.lora_name] = adapter
        return adapter

    def _known(self, request: LoRARequest) -> Adapter | None:
        """The adapter registered under the request's name, None for a new name; a LoRAError where that
        name holds another adapter."""
        known = self.adapters.get(request.lora_name)
        if known is not None and known.request.lora_path != request.lora_path:
            raise LoRAError(
                f"adapter {request.lora_name!r} is loaded already, from {known.request.lora_path}",
                hint="unload it first, or load this one under another name",
            )
        return known

    def find(self, name: str) -> LoRARequest | None:
        """The request of the adapter registered as `name` (any thread may ask)."""
        adapter = self.adapters.get(name)
        return adapter.request if adapter is not None else None

    def _check(self, name: str, weights: AdapterWeights) -> None:
        """The adapter fits this model's tables: its modules are adapted here, with these shapes and
        layers, and its rank fits max_lora_rank."""
        if weights.rank > self.config.max_lora_rank:
            raise LoRAError(
                f"adapter {name!r} ({weights.source}) has rank {weights.rank}, more than max_lora_rank "
                f"{self.config.max_lora_rank}",
                hint=f"start the server with --max-lora-rank {weights.rank} or more",
            )
        for (module_name, layer), (a, b) in sorted(weights.updates.items()):
            module = self.spec.module(module_name)
            where = f"adapter {name!r} ({weights.source}): {module_name} of layer {layer}"
            if module is None:
                adapted = ", ".join(m.name for m in self.spec.modules)
                raise LoRAError(
                    f"{where}: this model's step adapts {adapted} only", hint="use an adapter of those"
                )
            if layer >= module.layers:
                raise LoRAError(
                    f"{where}: this model has {module.layers} layers: the adapter is for another base model",
                    hint="use an adapter made for this base model",
                )
            if (a.shape[1], b.shape[0]) != (module.in_features, module.out_features):
                raise LoRAError(
                    f"{where} maps {a.shape[1]} -> {b.shape[0]} features, this model's "
                    f"{module.in_features} -> {module.out_features}: the adapter is for another base model",
                    hint="use an adapter made for this base model",
                )

    def unregister(self, name: str, waiting: int = 0) -> None:
        """Forget adapter `name`; refused while sequences hold it or `waiting` requests wait for it."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise LoRAError(
                f"no adapter {name!r} is loaded", hint=f"loaded: {', '.join(self.adapters) or 'none'}"
            )
        held = self._slots[adapter.slot].holders if adapter.slot is not None else 0
        if held or waiting:
            raise LoRAError(
                f"adapter {name!r} is in use by {held} running and {waiting} waiting sequences: not unloaded",
                hint="unload it once its requests finish (or abort them)",
            )
        if adapter.slot is not None:
            self._slots[adapter.slot] = _Slot()
        del self.adapters[name]

    # -- slots ------------------------------------------------------------------------------------

    def acquire(self, name: str) -> int | None:
        """The slot of adapter `name` for one more running sequence, copying it in where needed; None
        when every slot is held by other adapters' sequences."""
        adapter = self.adapters[name]
        if adapter.slot is None:
            free = [i for i, slot in enumerate(self._slots) if slot.holders == 0]
            if not free:
                return None
            index = min(free, key=lambda i: (self._slots[i].adapter is not None, self._slots[i].last_used))
            evicted = self._slots[index].adapter
            if evicted is not None:
                self.adapters[evicted].slot = None
            self._write(index, adapter.weights)
            self._slots[index] = _Slot(name)
            adapter.slot = index
        slot = self._slots[adapter.slot]
        slot.holders += 1
        slot.last_used = next(self._clock)
        return adapter.slot

    def release(self, name: str) -> None:
        adapter = self.adapters.get(name)
        if adapter is not None and adapter.slot is not None:
            slot = self._slots[adapter.slot]
            slot.holders = max(0, slot.holders - 1)

    def slot_of(self, name: str | None) -> int:
        """The slot a running sequence of adapter `name` reads (-1: the base model)."""
        if name is None:
            return -1
        slot = self.adapters[name].slot
        assert slot is not None, f"adapter {name} has no slot while running"
        return slot

    def _write(self, index: int, weights: AdapterWeights) -> None:
        """Slot `index` of every table: the adapter's rows, zeros elsewhere (modules and layers it leaves
        alone, ranks past its own)."""
        for module in self.spec.modules:
            a_table, b_table = self.tables[f"lora_a.{module.name}"], self.tables[f"lora_b.{module.name}"]
            a_table[:, index] = 0
            b_table[:, index] = 0
            for layer in range(module.layers):
                update = weights.updates.get((module.name, layer))
                if update is None:
                    continue
                a, b = update
                rank = a.shape[0]
                a_table[layer, index, :rank] = _like(a, a_table)
                b_table[layer, index, :rank] = _like(np.ascontiguousarray(b.T), b_table)

    def describe(self) -> list[dict[str, object]]:
        return [
            {"name": name, "id": a.request.lora_int_id, "path": a.request.lora_path, "rank": a.weights.rank}
            for name, a in self.adapters.items()
        ]


def _like(values: npt.NDArray[np.float32], table: Any) -> Any:
    """`values` as `table` holds them: its dtype, and its device for a torch tensor."""
    if isinstance(table, np.ndarray):
        return values.astype(table.dtype, copy=False)
    import torch

    return torch.from_numpy(values).to(dtype=table.dtype, device=table.device)
