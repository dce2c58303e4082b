"""A step's signature in a backend's description file (`signature` in step.json, onnx.json): written at
compile from the graph and the entry points the backend built, read back once at load."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kiln.backends.base import BackendError
from kiln.ir import Graph
from kiln.ir.step import STEP, StepSignature

SIGNATURE_FIELD = "signature"


def signature_record(
    graph: Graph, entry_points: Sequence[str] = (STEP,), embedding_size: int | None = None
) -> dict[str, Any]:
    """The description's entry for `graph`'s step with these entry points."""
    return {SIGNATURE_FIELD: StepSignature.of_graph(graph, entry_points, embedding_size).to_fields()}


def read_signature(description: Mapping[str, Any], where: Path) -> StepSignature:
    """The signature a description holds; refused for one written before kiln recorded it."""
    record = description.get(SIGNATURE_FIELD)
    if record is None:
        raise BackendError(
            f"{where}: compiled by a kiln that did not record the step's signature",
            hint="compile the model again with this version of kiln",
        )
    return StepSignature.from_fields(record)
