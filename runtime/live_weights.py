"""Live weight updates and sleep, as the engine loop sees them: new weights arrive as an executable of
the same compiled code (made off the loop by a `WeightSource`), and replace the served one between
requests, never inside a step or a sequence.

Pausing stops new requests from starting (they wait, held, until `resume`); `wait` lets the requests in
flight finish on the old weights, `abort` ends them at once (finish_reason "abort"). vLLM's third mode,
`keep`, is refused: a kept request would hold tokens of two weight versions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

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


class WeightSource(Protocol):
    """Makes executables of the served artifact's compiled code with other weights (kiln/refit.py)."""

    def from_path(self, path: str) -> Executable:
        """The weights of an HF safetensors folder or a GGUF with the model's tensor names and shapes."""
        ...

    def from_tensors(self, tensors: dict[str, torch.Tensor]) -> Executable:
        """The weights given by their HF names (every weight of the model)."""
        ...

    def from_artifact(self) -> Executable:
        """The artifact's own weights (after a sleep that dropped them)."""
        ...

    def check_tensor(self, name: str, dtype: str, shape: list[int]) -> None:
        """A WeightUpdateError for a tensor the model has not, or not in this shape or dtype."""
        ...
