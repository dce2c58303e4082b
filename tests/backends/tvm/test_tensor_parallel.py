"""Tensor parallelism through TVM-CPU: `compile_model(..., tensor_parallel_size=N)` writes one artifact
with the ranks' code (compiled once where their graphs are the same; its collectives are calls into
the runtime's packed functions `kiln.all_reduce` and `kiln.all_gather`, over gloo) and each rank's
sharded weights; loading it starts rank 0 in this process and
the others spawned (runtime/tensor_parallel.py), and the ranks give the whole model's logits within
1e-4 on the ragged batch. Loading it at another world size is refused, naming both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.backends.reference import ReferenceExecutable
from kiln.compiler import ModelOptions, compile_model, resolve
from kiln.frontend.capture import capture_weights
from kiln.frontend.load import load_model
from kiln.runtime.artifact import ArtifactError, load_artifact

TOLERANCE = 1e-4
HEADS = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8}


@pytest.mark.parametrize("world", [2, 4])
def test_a_tensor_parallel_tvm_artifact_gives_the_whole_models_logits(
    tiny_hf, ragged_run, tmp_path: Path, world: int
) -> None:
    tiny_hf("qwen2", tmp_path / "hf", HEADS)
    source = load_model(str(tmp_path / "hf"))
    captured = capture_weights(source.config, source.float_weights())
    whole = ragged_run([ReferenceExecutable(captured.graph, captured.weights)], 9)[0]
    options = ModelOptions(  # a float32 cache, as the whole model's: the sharding is what is checked
        str(tmp_path / "hf"),
        backend="tvm",
        quantization="none",
        kv_cache_dtype="f32",
        tensor_parallel_size=world,
    )
    compile_model(resolve(options), tmp_path / "art")

    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["compile"]["tensor_parallel_size"] == world
    ranks = manifest["targets"]["cpu"]["ranks"]
    # every rank's graph is the same (its first vocabulary id is a weight): one code folder for all
    assert [rank["folder"] for rank in ranks] == ["cpu/rank0"] * world
    assert not (tmp_path / "art" / "cpu" / "rank1").exists()
    assert len({rank["weights"] for rank in ranks}) == world  # each rank its own shard

    artifact = load_artifact(tmp_path / "art")
    try:
        assert artifact.executable.world == world  # type: ignore[attr-defined]
        ours = ragged_run([artifact.executable], 9)[0]
    finally:
        artifact.executable.close()
    for step in range(2):
        error = float((ours[step] - whole[step]).abs().max() / whole[step].abs().max())
        assert error < TOLERANCE, (world, step, error)

    with pytest.raises(ArtifactError, match=f"compiled for tensor-parallel size {world}, asked to run at 3"):
        load_artifact(tmp_path / "art", tensor_parallel_size=3)
