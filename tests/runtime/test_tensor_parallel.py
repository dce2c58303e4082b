"""Tensor-parallel execution (runtime/tensor_parallel.py): rank 0 in the engine's process, the other
ranks spawned, each step's inputs broadcast over gloo. SmolLM2 (9 heads, 3 KV heads) compiled at TP 3
makes the greedy tokens of one process. (A worker that dies: tests/server/test_tensor_parallel.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.compiler import ModelOptions, compile_model, resolve
from kiln.compiler.build import PipelineOptions, build_reference
from kiln.runtime.artifact import load_artifact
from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import LLMEngine
from kiln.runtime.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]


def _greedy(executable, tokenizer, max_tokens: int = 16) -> dict[str, list[int]]:
    engine = LLMEngine(executable, tokenizer, "m", 512, EngineConfig(num_blocks=64))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    return {o.request_id: o.outputs[0].token_ids for o in engine.run_to_completion()}


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "gguf"])  # float32, and each rank's cut of the Q4_1 blocks
def test_smollm2_at_tp3_makes_the_tokens_of_one_process(
    smollm2_gguf_path, tmp_path: Path, quantization: str | None
) -> None:
    whole = build_reference(str(smollm2_gguf_path), PipelineOptions(quantization=quantization))
    expected = _greedy(whole.executable, whole.tokenizer)
    options = ModelOptions(
        str(smollm2_gguf_path),
        backend="reference",
        quantization=quantization or "none",
        tensor_parallel_size=3,
    )
    compile_model(resolve(options), tmp_path / "tp3")
    ranks = load_artifact(tmp_path / "tp3").executable
    try:
        assert ranks.kv_cache_spec.num_kv_heads == 1
        assert _greedy(ranks, whole.tokenizer) == expected
    finally:
        ranks.close()
