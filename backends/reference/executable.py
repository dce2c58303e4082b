"""The reference backend's executable: any verified graph, run by the IR's interpreter (ir/interpreter.py)
on the CPU. It is the oracle every other backend is checked against, so it favours clarity over speed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kiln.backends.base import BackendError, Hidden, KVCacheSpec, Logits
from kiln.backends.kv_manifest import image_rows_width, takes_visible_ends
from kiln.backends.lora_tables import LoRASpec, with_lora_inputs
from kiln.ir import IMAGE_ROWS_INPUT, KV_CACHE_INPUT, VISIBLE_ENDS_INPUT, Graph, StepInputs, verify
from kiln.ir.deferred import materialize
from kiln.ir.interpreter import check_weights, interpret, last_uses
from kiln.ir.step import causal_visible_ends
from kiln.passes.embed import embed_graph


class ReferenceExecutable:
    def __init__(self, graph: Graph, weights: dict[str, torch.Tensor]) -> None:
        verify(graph)
        check_weights(graph, weights)
        self.graph = graph
        self.weights = {name: materialize(weight) for name, weight in weights.items()}
        self.kv_cache_spec = KVCacheSpec.of_graph(graph)
        self._last_uses = last_uses(graph)
        self._image_rows = image_rows_width(graph)  # a vision-language model's hidden size
        self._visible_ends = takes_visible_ends(graph)
        self.lora_spec = LoRASpec.of_graph(graph)
        self._no_lora = self.lora_spec.allocate(0, 0) if self.lora_spec is not None else {}
        self._embed_graph = embed_graph(graph)
        self._embed_last_uses = last_uses(self._embed_graph) if self._embed_graph is not None else None

    @property
    def embeds(self) -> bool:
        return self._embed_graph is not None

    @property
    def embedding_size(self) -> int:
        return int(self._embed_graph.outputs[0].type.shape[-1]) if self._embed_graph is not None else 0

    def step(self, inputs: StepInputs, kv_cache: torch.Tensor) -> Logits:
        (logits,) = interpret(self.graph, self.weights, self._given(inputs, kv_cache), self._last_uses)
        return logits.to(torch.float32).numpy()

    def embed(self, inputs: StepInputs, kv_cache: torch.Tensor) -> Hidden:
        """The final hidden states [L, hidden] of the `logits_indices` rows (backends.base.Embedder)."""
        if self._embed_graph is None:
            raise BackendError("this model's graph has no single LM head to stop before: it cannot embed")
        given = self._given(inputs, kv_cache)
        (hidden,) = interpret(self._embed_graph, self.weights, given, self._embed_last_uses)
        return hidden.to(torch.float32).numpy()

    def _given(self, inputs: StepInputs, kv_cache: torch.Tensor) -> dict[str, Any]:
        if self.lora_spec is not None:
            inputs = with_lora_inputs(inputs, self.lora_spec, self._no_lora)
        given = {**inputs.as_dict(), KV_CACHE_INPUT: kv_cache}
        if self._image_rows is not None and IMAGE_ROWS_INPUT not in given:  # a step without images
            given[IMAGE_ROWS_INPUT] = torch.zeros(0, self._image_rows, dtype=torch.float32)
        if self._visible_ends and VISIBLE_ENDS_INPUT not in given:
            given[VISIBLE_ENDS_INPUT] = causal_visible_ends(inputs)
        return given


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
