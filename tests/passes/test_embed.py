"""The embed graph: the step's graph up to the LM head, before and after the pass pipeline."""

from __future__ import annotations

import dataclasses

from kiln.compiler.build import optimize
from kiln.compiler.options import PipelineOptions
from kiln.frontend.capture import capture_weights
from kiln.ir import verify
from kiln.passes.embed import embed_graph
from tests.conftest import TINY_CONFIG, tiny_weights


def test_the_captured_and_the_optimized_graphs_stop_before_the_head() -> None:
    captured = capture_weights(TINY_CONFIG, tiny_weights()).graph
    optimized = optimize(TINY_CONFIG, tiny_weights(), PipelineOptions(quantization="int4")).program.graph
    for graph in (captured, optimized):
        embedded = embed_graph(graph)
        assert embedded is not None
        verify(embedded)
        (output,) = embedded.outputs
        assert output.type.shape == ("L", TINY_CONFIG.hidden_size)
        names = [param.name for param in embedded.params]
        assert not any(name.startswith("lm_head") for name in names)
        assert names == [param.name for param in graph.params if param.name in names]  # the step's order
        assert embedded.inputs == graph.inputs  # the step's calling convention


def test_a_soft_capped_head_is_left_out_too() -> None:
    config = dataclasses.replace(TINY_CONFIG, final_logit_softcapping=30.0)
    embedded = embed_graph(capture_weights(config, tiny_weights()).graph)
    assert embedded is not None
    assert "softcap" not in embedded.op_counts()


def test_a_graph_without_a_single_head_has_none() -> None:
    graph = capture_weights(TINY_CONFIG, tiny_weights()).graph
    assert embed_graph(dataclasses.replace(graph, outputs=[graph.inputs[0]])) is None
