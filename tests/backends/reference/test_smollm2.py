"""SmolLM2-135M-Instruct from its GGUF, through capture → IR → reference backend, against transformers."""

from __future__ import annotations

import pytest
import torch

from kiln.ir.step import SequenceSlice, build_step_inputs
from kiln.runtime.greedy import greedy_generate

PROMPTS = [
    "The three primary colours are",
    "def fibonacci(n):\n    ",
    "Translate to French: the kiln is hot.",
]
NUM_TOKENS = 32


def _prompt_ids(built, prompt: str, chat: bool) -> list[int]:
    tokenizer = built.tokenizer
    if not chat:
        return tokenizer.encode(prompt)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True], ids=["raw", "chat"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_match_transformers(
    smollm2_built, smollm2_hf, hf_greedy, prompt: str, chat: bool
) -> None:
    prompt_ids = _prompt_ids(smollm2_built, prompt, chat)
    eos_ids = smollm2_built.tokenizer.eos_token_ids
    ours = greedy_generate(smollm2_built.executable, prompt_ids, NUM_TOKENS, eos_ids)
    assert ours == hf_greedy(smollm2_hf, prompt_ids, NUM_TOKENS, eos_ids)
    assert len(ours) == NUM_TOKENS or ours[-1] in eos_ids


@pytest.mark.slow
def test_prefill_logits_match_transformers(smollm2_built, smollm2_hf) -> None:
    generator = torch.Generator().manual_seed(7)
    prompt_ids = torch.randint(100, smollm2_built.config.vocab_size, (40,), generator=generator).tolist()
    kv_cache = smollm2_built.executable.kv_cache_spec.allocate(4, 16)
    inputs = build_step_inputs([SequenceSlice(prompt_ids, 0, [3, 1, 2])], 16)
    ours = torch.from_numpy(smollm2_built.executable.step(inputs, kv_cache))[0]
    with torch.no_grad():
        theirs = smollm2_hf(torch.tensor([prompt_ids])).logits[0, -1]
    assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-4
