"""Embedding requests in the engine: the prompt through `embed`, pooled; checked against the hidden
states the step graph computes on its own, in every batch shape, beside generating requests."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kiln.backends.reference import ReferenceExecutable
from kiln.ir.interpreter import interpret
from kiln.passes.embed import embed_graph
from kiln.runtime.pooling import PoolingParams
from kiln.runtime.sampling_params import SamplingParams

PROMPT = list(range(2, 41))  # 39 tokens: ten blocks of 4, the last one partial


def _hidden_rows(executable: ReferenceExecutable, prompt: list[int]) -> np.ndarray:
    """Every prompt row's final hidden state, the whole prompt in one step of its own."""
    from kiln.ir.step import SequenceSlice, build_step_inputs

    num_blocks = (len(prompt) + 3) // 4
    inputs = build_step_inputs(
        [SequenceSlice(prompt, 0, list(range(num_blocks)), list(range(len(prompt))))], 4, 96, False, False
    )
    cache = executable.kv_cache_spec.allocate(num_blocks, 4)
    graph = embed_graph(executable.graph)
    assert graph is not None
    given: dict[str, Any] = {**inputs.as_dict(), "kv_cache": cache}
    (hidden,) = interpret(graph, executable.weights, given)
    return hidden.to(torch.float64).numpy()


def _expected(rows: np.ndarray, params: PoolingParams) -> np.ndarray:
    vector = rows[-1] if params.pooling == "last" else rows.mean(axis=0)
    vector = vector[: params.dimensions] if params.dimensions else vector
    return vector / np.linalg.norm(vector) if params.normalize else vector


@pytest.mark.parametrize("batched_tokens", [64, 8])  # whole prompts, and 8-token chunks
def test_pooled_vectors_match_the_graphs_hidden_states(
    make_tiny_engine, tiny_model, batched_tokens: int
) -> None:
    rows = _hidden_rows(tiny_model[0], PROMPT)
    engine = make_tiny_engine(max_num_batched_tokens=batched_tokens)
    engine.add_request("generating", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0))
    kinds = {
        "last": PoolingParams("last"),
        "mean": PoolingParams("mean", normalize=False),
        "short": PoolingParams("mean", dimensions=8),
    }
    for name, params in kinds.items():
        engine.add_request(name, PROMPT, pooling=params)
    finished = {output.request_id: output for output in engine.run_to_completion()}
    for name, params in kinds.items():
        output = finished[name]
        assert output.outputs[0].token_ids == [] and output.finished
        assert np.allclose(output.embedding, _expected(rows, params), atol=1e-5), name
    alone = make_tiny_engine()
    alone.add_request("generating", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0))
    (expected,) = alone.run_to_completion()
    assert finished["generating"].outputs[0].token_ids == expected.outputs[0].token_ids


def test_last_pooling_takes_cached_prefixes_and_mean_pooling_does_not(make_tiny_engine, tiny_model) -> None:
    rows = _hidden_rows(tiny_model[0], PROMPT)
    engine = make_tiny_engine()
    engine.add_request("warm", PROMPT, SamplingParams(max_tokens=1))
    engine.run_to_completion()
    for name, params in {"last": PoolingParams("last"), "mean": PoolingParams("mean")}.items():
        computed_before = engine.stats.num_computed_tokens
        engine.add_request(name, PROMPT, pooling=params)
        (output,) = engine.run_to_completion()
        computed = engine.stats.num_computed_tokens - computed_before
        assert computed == (len(PROMPT) - 36 if name == "last" else len(PROMPT)), name
        assert np.allclose(output.embedding, _expected(rows, params), atol=1e-5), name


def test_a_preempted_mean_pooling_request_starts_its_sum_again(make_tiny_engine, tiny_model) -> None:
    rows = _hidden_rows(tiny_model[0], PROMPT)
    engine = make_tiny_engine(num_blocks=16, max_num_batched_tokens=8)  # not both at their full length
    engine.add_request("long", [3] * 20, SamplingParams(max_tokens=30, temperature=0))
    engine.add_request("mean", PROMPT, pooling=PoolingParams("mean"))
    finished = {output.request_id: output for output in engine.run_to_completion()}
    assert engine.scheduler.num_preemptions > 0
    assert np.allclose(finished["mean"].embedding, _expected(rows, PoolingParams("mean")), atol=1e-5)


def test_bad_pooling_requests_are_refused(make_tiny_engine) -> None:
    engine = make_tiny_engine()
    with pytest.raises(ValueError, match="hidden size 32, got 33"):
        engine.add_request("wide", PROMPT, pooling=PoolingParams(dimensions=33))
    with pytest.raises(ValueError, match="pooling must be one of last, mean"):
        PoolingParams("cls")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the prompt"):
        engine.add_request("long", [3] * 256, pooling=PoolingParams())


def test_an_executable_without_embed_is_refused_by_name(make_tiny_engine) -> None:
    engine = make_tiny_engine(step_delay_s=0.001)  # a FaultyExecutable: it has no `embed`
    with pytest.raises(ValueError, match="this model cannot embed"):
        engine.add_request("e", PROMPT, pooling=PoolingParams())
