"""SmolLM2 float32 on ONNX Runtime through the runtime: greedy tokens equal the reference backend's,
and a request's tokens do not depend on what it is batched with (chunked prefill, preemption)."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import LLMEngine
from kiln.runtime.greedy import greedy_generate
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import SchedulerConfig

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _engine(loaded, num_blocks: int = 256, max_num_seqs: int = 16, budget: int = 64) -> LLMEngine:
    config = EngineConfig(num_blocks=num_blocks, scheduler=SchedulerConfig(max_num_seqs, budget))
    return LLMEngine(loaded.executable, loaded.tokenizer, loaded.model_id, 2048, config)


def _prompts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    lengths = [5 + 9 * i for i in range(count)]  # 5 .. 140 tokens: many cross block and chunk boundaries
    return [torch.randint(100, 49000, (n,), generator=generator).tolist() for n in lengths]


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    return {o.request_id: o.outputs[0].token_ids for o in engine.run_to_completion()}


@pytest.mark.slow  # the reference's 32 steps: 14 s on an idle machine
def test_greedy_32_tokens_equal_the_reference(onnx_smollm2_ort, smollm2_o2) -> None:
    prompt = onnx_smollm2_ort.tokenizer.encode("The capital of France is")
    ours = greedy_generate(onnx_smollm2_ort.executable, prompt, 32)
    assert ours == greedy_generate(smollm2_o2.executable, prompt, 32)


@pytest.mark.slow
def test_batch_invariance_with_chunked_prefill_and_preemption(onnx_smollm2_ort) -> None:
    prompts = _prompts(16)
    alone = {}
    for i, prompt in enumerate(prompts):
        alone |= {f"r{i}": _run(_engine(onnx_smollm2_ort), [prompt], GREEDY)["r0"]}
    together = _engine(onnx_smollm2_ort)
    assert _run(together, prompts, GREEDY) == alone
    assert together.stats.num_steps < sum(len(p) for p in prompts)  # prompts really were batched

    cramped = _engine(onnx_smollm2_ort, num_blocks=24)  # 23 usable blocks of 16 tokens for 16 requests
    assert _run(cramped, prompts, GREEDY) == alone
    assert cramped.scheduler.num_preemptions > 0
