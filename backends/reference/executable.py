"""The reference backend's executable: any verified graph, run by the IR's interpreter (ir/interpreter.py)
on the CPU. It is the oracle every other backend is checked against, so it favours clarity over speed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kiln.backends.base import Executable, Hidden, Logits
from kiln.ir import KV_CACHE_INPUT, Graph, StepInputs, verify
from kiln.ir.deferred import materialize
from kiln.ir.interpreter import check_weights, interpret, last_uses
from kiln.ir.step import EMBED, STEP, StepSignature, fill_absent
from kiln.passes.embed import embed_graph


class ReferenceExecutable(Executable):
    def __init__(self, graph: Graph, weights: dict[str, torch.Tensor]) -> None:
        verify(graph)
        check_weights(graph, weights)
        self.graph = graph
        self.weights = {name: materialize(weight) for name, weight in weights.items()}
        self._last_uses = last_uses(graph)
        self._embed_graph = embed_graph(graph)
        self._embed_last_uses = last_uses(self._embed_graph) if self._embed_graph is not None else None
        if self._embed_graph is None:
            self.signature = StepSignature.of_graph(graph)
        else:
            width = int(self._embed_graph.outputs[0].type.shape[-1])
            self.signature = StepSignature.of_graph(graph, (STEP, EMBED), width)

    def step(self, inputs: StepInputs, kv_cache: torch.Tensor) -> Logits:
        (logits,) = interpret(self.graph, self.weights, self._given(inputs, kv_cache), self._last_uses)
        return logits.to(torch.float32).numpy()

    def embed(self, inputs: StepInputs, kv_cache: torch.Tensor) -> Hidden:
        """The final hidden states [L, hidden] of the `logits_indices` rows."""
        if self._embed_graph is None:
            return super().embed(inputs, kv_cache)
        given = self._given(inputs, kv_cache)
        (hidden,) = interpret(self._embed_graph, self.weights, given, self._embed_last_uses)
        return hidden.to(torch.float32).numpy()

    def _given(self, inputs: StepInputs, kv_cache: torch.Tensor) -> dict[str, Any]:
        return {**fill_absent(inputs, self.signature).as_dict(), KV_CACHE_INPUT: kv_cache}


class ReferenceImageEncoder:
    """An image encoder's graph, interpreted."""

    def __init__(self, graph: Graph, weights: dict[str, torch.Tensor]) -> None:
        verify(graph)
        check_weights(graph, weights)
        self.graph = graph
        self.weights = {name: materialize(weight) for name, weight in weights.items()}

    def encode(self, inputs: Mapping[str, npt.NDArray[Any]]) -> npt.NDArray[np.float32]:
        (rows,) = interpret(self.graph, self.weights, inputs)
        return rows.to(torch.float32).numpy()
