"""SmolLM2 float32 on ONNX Runtime through the runtime: greedy tokens equal the reference backend's,
and a request's tokens do not depend on what it is batched with (chunked prefill, preemption)."""

from __future__ import annotations

import pytest

from kiln.runtime.greedy import greedy_generate


@pytest.mark.slow  # the reference's 32 steps: 14 s on an idle machine
def test_greedy_32_tokens_equal_the_reference(onnx_smollm2_ort, smollm2_o2) -> None:
    prompt = onnx_smollm2_ort.tokenizer.encode("The capital of France is")
    ours = greedy_generate(onnx_smollm2_ort.executable, prompt, 32)
    assert ours == greedy_generate(smollm2_o2.executable, prompt, 32)


@pytest.mark.slow
def test_batch_invariance_with_chunked_prefill_and_preemption(
    onnx_smollm2_ort, check_batch_invariance
) -> None:
    loaded = onnx_smollm2_ort
    check_batch_invariance(loaded.executable, loaded.tokenizer, loaded.model_id)
