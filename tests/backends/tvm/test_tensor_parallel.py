"""Tensor parallelism through TVM-CPU: each rank's sharded program compiles with its collectives as
calls into the runtime's packed functions (`kiln.all_reduce`, `kiln.all_gather`, over gloo), and the
ranks together give the whole model's logits within 1e-4 on the ragged batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.backends.base import CompileSettings
from kiln.backends.reference import ReferenceExecutable
from kiln.backends.targets import Target
from kiln.backends.tvm.backend import TVMBackend
from kiln.frontend.capture import capture_weights
from kiln.frontend.load import load_model
from kiln.ir import Program
from kiln.passes import PassManager, PassOptions, pipeline
from kiln.passes.shard import shard

TOLERANCE = 1e-4


@pytest.mark.parametrize("world", [2, 4])
def test_tvm_ranks_together_give_the_whole_models_logits(
    tiny_hf, ragged_run, run_ranks, tmp_path: Path, world: int
) -> None:
    tiny_hf("qwen2", tmp_path / "hf", {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8})
    source = load_model(str(tmp_path / "hf"))
    captured = capture_weights(source.config, source.float_weights())
    program = Program(captured.graph, captured.weights)
    whole = ragged_run([ReferenceExecutable(program.graph, program.weights)], 9)[0]
    parts = []
    for rank in range(world):  # compiled here, loaded and run in each rank's process
        part = PassManager(pipeline(2, PassOptions())).run(shard(program, world, rank))[0]
        TVMBackend().compile(part, Target("cpu"), tmp_path / f"rank{rank}", CompileSettings())
        parts.append(part)

    def work(rank: int) -> list[torch.Tensor]:
        executable = TVMBackend().load(tmp_path / f"rank{rank}", parts[rank].weights, Target("cpu"))
        first, second, _ = ragged_run([executable], 9)[0]
        return [first.clone(), second.clone()]

    for rank, logits in enumerate(run_ranks(world, work)):
        for step, (ours, reference) in enumerate(zip(logits, whole[:2], strict=True)):
            error = float((ours - reference).abs().max() / reference.abs().max())
            assert error < TOLERANCE, (world, rank, step, error)
