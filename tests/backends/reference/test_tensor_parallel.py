"""Tensor parallelism on the reference backend: the shard pass (passes/shard.py) splits tiny models of
several families; the ranks together (forked processes over gloo, running the collectives through
torch.distributed) give the whole model's logits within 1e-4 on the ragged batch, for TP 2 and 4, with
KV heads split and replicated. Each rank's program verifies and prints; the refusals name their
numbers. (Here rather than under tests/passes/ for the tiny-model fixtures of tests/backends/.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.backends.reference import ReferenceExecutable
from kiln.frontend.capture import capture_weights
from kiln.frontend.load import load_model
from kiln.ir import Program
from kiln.ir.deferred import materialize
from kiln.ir.text import print_graph
from kiln.passes.base import PassError
from kiln.passes.shard import shard

TOLERANCE = 1e-4  # max abs difference over max abs logit


def _program(save_tiny_hf: Callable[..., Any], kind: str, path: Path, **overrides: Any) -> Program:
    save_tiny_hf(kind, path, overrides)
    source = load_model(str(path))
    captured = capture_weights(source.config, source.float_weights())
    return Program(captured.graph, captured.weights)


@pytest.mark.parametrize(
    ("kind", "overrides", "world"),
    [
        ("llama", {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8}, 2),
        ("llama", {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8}, 4),
        (
            "llama_tied",
            {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8},
            4,
        ),  # KV heads kept
        ("qwen2", {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8}, 2),  # q/k/v biases
        ("qwen3", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}, 2),  # q/k norms
        ("gemma3", {"num_attention_heads": 4, "num_key_value_heads": 2}, 2),  # window, soft-capping
        ("mistral_window", {"num_attention_heads": 4, "num_key_value_heads": 2}, 2),
    ],
)
def test_ranks_together_give_the_whole_models_logits(
    tiny_hf, ragged_run, run_ranks, tmp_path: Path, kind: str, overrides: dict[str, Any], world: int
) -> None:
    program = _program(tiny_hf, kind, tmp_path, **overrides)
    whole = ragged_run([ReferenceExecutable(program.graph, program.weights)], 5)[0]

    def work(rank: int) -> list[torch.Tensor]:
        part = shard(program, world, rank)
        first, second, _ = ragged_run([ReferenceExecutable(part.graph, part.weights)], 5)[0]
        return [first.clone(), second.clone()]

    for rank, logits in enumerate(run_ranks(world, work)):
        for step, (ours, reference) in enumerate(zip(logits, whole[:2], strict=True)):
            error = float((ours - reference).abs().max() / reference.abs().max())
            assert error < TOLERANCE, (kind, world, rank, step, error)


def test_a_ranks_program_verifies_and_prints(tiny_hf, tmp_path: Path) -> None:
    program = _program(tiny_hf, "qwen2", tmp_path, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    part = shard(program, 4, 1)
    text = print_graph(part.graph)
    layers = 2
    assert text.count("all_reduce(") == 2 * layers + 1  # o_proj and down_proj a layer, the embedding
    assert text.count("all_gather(") == 1 and "shard_embedding(" in text
    cache = next(v for v in part.graph.inputs if v.name == "kv_cache")
    assert cache.type.shape[4] == 1  # 2 KV heads over 4 ranks: one each
    q = part.weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (2 * 8, 64)
    assert torch.equal(
        materialize(q), materialize(program.weights["model.layers.0.self_attn.q_proj.weight"])[16:32]
    )
    down = part.weights["model.layers.0.mlp.down_proj.weight"]
    assert down.shape == (64, 128 // 4)
    assert shard(program, 1, 0) is program


@pytest.mark.parametrize(
    ("world", "message"),
    [
        (3, "does not divide the 8 attention heads"),
        (0, "does not exist"),
    ],
)
def test_sizes_that_do_not_split_are_refused(tiny_hf, tmp_path: Path, world: int, message: str) -> None:
    program = _program(tiny_hf, "llama", tmp_path, num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    with pytest.raises(PassError, match=message):
        shard(program, world, 0)


def test_kv_heads_and_mixtures_of_experts_are_refused(tiny_hf, tmp_path: Path) -> None:
    program = _program(
        tiny_hf,
        "llama",
        tmp_path / "a",
        hidden_size=96,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=8,
    )
    with pytest.raises(PassError, match="tensor-parallel size 6 and the 4 KV heads"):
        shard(program, 6, 0)
    with pytest.raises(PassError, match="cannot shard ops moe"):
        shard(_program(tiny_hf, "mixtral", tmp_path / "b"), 2, 0)
