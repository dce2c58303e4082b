"""The offline API in vLLM's shape, on SmolLM2."""

from __future__ import annotations

import pytest

import kiln


@pytest.mark.slow
def test_llm_generate_keeps_the_prompt_order(smollm2_gguf_path) -> None:
    llm = kiln.LLM(str(smollm2_gguf_path), num_blocks=128)
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Water boils at"]
    params = kiln.SamplingParams(temperature=0, max_tokens=6)
    outputs = llm.generate(prompts, params)
    assert [o.prompt for o in outputs] == prompts
    assert all(o.finished and 1 <= len(o.outputs[0].token_ids) <= 6 for o in outputs)
    assert "Paris" in outputs[0].outputs[0].text
    assert outputs[1].outputs[0].text.strip().startswith("5")
    one = llm.generate(prompts[1], params)[0]
    assert one.outputs[0].token_ids == outputs[1].outputs[0].token_ids
    reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params)
    assert "Paris" in reply.outputs[0].text
    with pytest.raises(ValueError, match="sampling params for 3 prompts"):
        llm.generate(prompts, [params])
