"""The LoRA passes: a lora op after every adapted linear (float and quantized), the pieces of a fused
linear updated by one op, the fusions after them unchanged; a program that is verified and computes the
reference's logits."""

from __future__ import annotations

import pytest

from kiln.compiler.build import optimize
from kiln.compiler.options import PipelineOptions
from kiln.ir import verify
from kiln.passes.lora import adapted_module
from tests.conftest import TINY_CONFIG, tiny_weights


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_every_adapted_linear_gets_one_update_and_the_fusions_still_apply(quantization: str | None) -> None:
    plain = optimize(TINY_CONFIG, tiny_weights(), PipelineOptions(quantization=quantization)).program.graph
    graph = optimize(
        TINY_CONFIG, tiny_weights(), PipelineOptions(enable_lora=True, quantization=quantization)
    ).program.graph
    verify(graph)
    counts, plain_counts = graph.op_counts(), plain.op_counts()
    assert counts.pop("lora") == 4 * TINY_CONFIG.num_hidden_layers  # q|k|v, o, gate|up, down
    assert counts.pop("take_rows") == plain_counts.pop("take_rows") + 1  # the logits rows' slots
    assert counts == plain_counts  # the same ops otherwise: fused q|k|v and gate|up, swiglu, add_rms_norm
    sizes = sorted(
        tuple(node.attrs["sizes"]) for node in graph.nodes if node.op == "lora" and node.attrs["layer"] == 0
    )
    assert sizes == [(32,), (32,), (32, 16, 16), (64, 64)]
    inputs = {value.name: value.type.text() for value in graph.inputs}
    assert inputs["lora_slots"] == "i64[T]"
    assert inputs["lora_a.k_proj"] == "f32[2,LS,LR,32]" and inputs["lora_b.k_proj"] == "f32[2,LS,LR,16]"
    assert inputs["lora_a.down_proj"] == "f32[2,LS,LR,64]" and inputs["lora_b.gate_proj"] == "f32[2,LS,LR,64]"


def test_without_the_option_nothing_changes() -> None:
    graph = optimize(TINY_CONFIG, tiny_weights(), PipelineOptions()).program.graph
    assert "lora" not in graph.op_counts()
    assert not any(value.name.startswith("lora") for value in graph.inputs)


@pytest.mark.parametrize(
    ("weight", "found"),
    [
        ("model.layers.3.self_attn.q_proj.weight", (3, "q_proj")),
        ("model.layers.0.mlp.down_proj.weight.qweight", (0, "down_proj")),
        ("model.language_model.layers.12.mlp.gate_up_proj.weight", (12, "gate_up_proj")),
        ("lm_head.weight", None),
        ("model.layers.0.self_attn.q_norm.weight", None),
        ("model.layers.1.mlp.experts.gate_proj", None),
    ],
)
def test_which_weights_adapters_reach(weight: str, found: tuple[int, str] | None) -> None:
    assert adapted_module(weight) == found


def test_tables_in_another_dtype_than_the_activations() -> None:
    options = PipelineOptions(enable_lora=True, lora_dtype="f16")
    graph = optimize(TINY_CONFIG, tiny_weights(), options).program.graph
    verify(graph)
    inputs = {value.name: value.type.text() for value in graph.inputs}
    assert inputs["lora_a.q_proj"] == "f16[2,LS,LR,32]" and inputs["lora_b.down_proj"] == "f16[2,LS,LR,32]"
    assert inputs["kv_cache"].startswith("f32")
