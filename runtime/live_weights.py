"""Live weight updates and sleep, as the engine loop sees them: new weights arrive as an executable of
the same compiled code (made off the loop by a `WeightSource`), and replace the served one between
requests, never inside a step or a sequence.

Pausing stops new requests from starting (they wait, held, until `resume`); `wait` lets the requests in
flight finish on the old weights, `abort` ends them at once (finish_reason "abort"). vLLM's third mode,
`keep`, is refused: a kept request would hold tokens of two weight versions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from kiln.errors import KilnError

if TYPE_CHECKING:
    import torch

    from kiln.backends.base import Executable

PauseMode = Literal["wait", "abort"]
PAUSE_MODES: tuple[str, ...] = ("wait", "abort")


class WeightUpdateError(KilnError):
    """New weights that cannot be served (a name, shape or dtype the model does not have, a file that
    cannot be read, a transfer that broke off); the served weights are unchanged."""


class EngineAsleepError(KilnError):
    """The engine sleeps (its KV cache, maybe its weights, handed back): no request can start."""


@dataclass(frozen=True)
class WeightVersion:
    """Which weights serve: `number` counts changes from 0 (the artifact's), `source` says where they
    came from ("artifact", "disk:<path>", "distributed")."""

    number: int
    source: str


@runtime_checkable
class StagedWeights(Protocol):
    """New weights that take their place on the engine's thread, between steps: a tensor-parallel
    model's shards travel to its workers over the step's own process group."""

    def commit(self) -> Executable:
        """Every rank serves the new weights (the executable to serve), or none does (BackendError)."""
        ...


class WeightSource(Protocol):
    """Makes executables of the served artifact's compiled code with other weights (compiler/refit.py)."""

    def from_path(self, path: str) -> Executable | StagedWeights:
        """The weights of an HF safetensors folder or a GGUF with the model's tensor names and shapes."""
        ...

    def from_tensors(self, tensors: dict[str, torch.Tensor]) -> Executable | StagedWeights:
        """The weights given by their HF names (every weight of the model)."""
        ...

    def from_artifact(self) -> Executable:
        """The artifact's own weights (after a sleep that dropped them)."""
        ...

    def check_tensor(self, name: str, dtype: str, shape: list[int]) -> None:
        """A WeightUpdateError for a tensor the model has not, or not in this shape or dtype."""
        ...


def check_refittable(manifest: dict[str, Any], entry: dict[str, Any]) -> None:
    """A WeightUpdateError for an artifact (its manifest, the served target's entry) whose weights
    cannot be replaced."""
    if "vision" in manifest:
        raise WeightUpdateError("weight updates of a vision-language model are not supported yet")
    if entry["backend"] == "tensorrt":
        raise WeightUpdateError(
            "TensorRT engines hold their weights: they cannot be replaced without a rebuild",
            hint="serve the model with --backend tvm or onnxruntime to update weights",
        )


class OnFirstUse:
    """A WeightSource made when first asked (kiln.compiler.refit imports torch and the compile pipeline: a
    server that never updates does not pay for them)."""

    def __init__(self, make: Callable[[], WeightSource]) -> None:
        self._make = make
        self._source: WeightSource | None = None
        self._lock = threading.Lock()

    def _get(self) -> WeightSource:
        with self._lock:
            if self._source is None:
                self._source = self._make()
            return self._source

    def from_path(self, path: str) -> Executable | StagedWeights:
        return self._get().from_path(path)

    def from_tensors(self, tensors: dict[str, torch.Tensor]) -> Executable | StagedWeights:
        return self._get().from_tensors(tensors)

    def from_artifact(self) -> Executable:
        return self._get().from_artifact()

    def check_tensor(self, name: str, dtype: str, shape: list[int]) -> None:
        self._get().check_tensor(name, dtype, shape)
