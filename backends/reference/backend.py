"""The reference backend as an artifact builder: its "compiled code" is the optimized graph as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kiln.backends.base import (
    BackendError,
    Capabilities,
    CompiledCode,
    CompileSettings,
    Executable,
    ImageEncoder,
    Refusal,
    StoredWeight,
    integer_dot_refusal,
)
from kiln.backends.reference.executable import ReferenceExecutable, ReferenceImageEncoder
from kiln.backends.targets import Target
from kiln.ir import Graph, Program, graph_from_json, graph_to_json
from kiln.ir.host_arrays import torch_weights
from kiln.passes.base import KV_CACHE_DTYPES

GRAPH_FILE = "graph.json"


class ReferenceBackend:
    name = "reference"
    copies_weights = False

    def version(self) -> str:
        return f"torch-{torch.__version__.split('+')[0]}"

    def capabilities(self, target: Target) -> Capabilities:
        """Everything, on this CPU only: it interprets the graph with torch."""
        unavailable = None
        if target.name != "cpu":
            unavailable = Refusal(
                f"the reference backend runs on the CPU with portable torch code only; target {target.name} "
                "needs a compiling backend (tvm, onnxruntime, tensorrt)"
            )
        return Capabilities(
            unavailable=unavailable,
            kv_cache_dtypes=frozenset({None, *KV_CACHE_DTYPES}),
            tensor_parallel=True,
            why_not={"activation_bits": integer_dot_refusal("backend reference")},
        )

    def compile(
        self, program: Program, target: Target, folder: Path, settings: CompileSettings
    ) -> CompiledCode:
        folder.mkdir(parents=True, exist_ok=True)
        text = json.dumps(graph_to_json(program.graph), indent=1, sort_keys=True) + "\n"
        (folder / GRAPH_FILE).write_text(text)
        return CompiledCode([GRAPH_FILE], {"all ops": "torch reference"})

    def check_structure(self, folder: Path, target: Target) -> list[str]:
        graph_from_json(json.loads((folder / GRAPH_FILE).read_text()))
        return [f"{GRAPH_FILE} parses as a graph"]

    def compile_encoder(
        self, program: Program, target: Target, folder: Path, settings: CompileSettings
    ) -> CompiledCode:
        return self.compile(program, target, folder, settings)  # its "code" is the graph, as the step's

    def load_encoder(self, folder: Path, weights: dict[str, torch.Tensor], target: Target) -> ImageEncoder:
        return ReferenceImageEncoder(_read_graph(folder), torch_weights(weights))

    def stored_weights(self, folder: Path) -> list[StoredWeight] | None:
        return None  # the program's weights as they are

    def load(self, folder: Path, weights: dict[str, torch.Tensor], target: Target) -> Executable:
        return ReferenceExecutable(_read_graph(folder), torch_weights(weights))


def _read_graph(folder: Path) -> Graph:
    try:
        return graph_from_json(json.loads((folder / GRAPH_FILE).read_text()))
    except (OSError, json.JSONDecodeError, KeyError) as error:
        raise BackendError(f"{folder / GRAPH_FILE}: cannot read the graph ({error})") from None
