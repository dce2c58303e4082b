"""Graphs through JSON and weights through safetensors come back equal."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.ir import IRError, graph_from_json, graph_to_json, load_weights, print_graph, save_weights


def test_graph_json_round_trip(smollm2_built) -> None:
    graph = smollm2_built.captured.graph
    data = json.loads(json.dumps(graph_to_json(graph)))
    assert print_graph(graph_from_json(data)) == print_graph(graph)


def test_unknown_graph_format_is_refused(smollm2_built) -> None:
    data = graph_to_json(smollm2_built.captured.graph)
    data["format_version"] = 99
    with pytest.raises(IRError, match="format version 99"):
        graph_from_json(data)


def test_weights_round_trip(tmp_path) -> None:
    weights = {"b": torch.randn(3, 4), "a": torch.arange(6, dtype=torch.int64)}
    save_weights(weights, tmp_path / "w.safetensors")
    loaded = load_weights(tmp_path / "w.safetensors")
    assert set(loaded) == set(weights)
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
