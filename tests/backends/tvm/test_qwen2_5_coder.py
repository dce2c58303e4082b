"""Qwen2.5-Coder-0.5B-Instruct, the Q4_K_M GGUF people download (Q4_K, Q6_K, Q5_0, Q8_0 tensors), on the
default path (`kiln.LLM(model)`: TVM for this CPU, the GGUF's own blocks, token embedding included)
against transformers float32 loading the same GGUF: 32 greedy tokens for 3 prompts, raw and
chat-templated. The same check on Qwen2.5-Coder-1.5B-Instruct (3 chat-templated prompts; a 2-minute
compile) is a benchmark's: `bench/agreement.py transformers qwen2.5-coder-1.5b-instruct --chat-only`
asserts it (docs/benchmarks.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # a compile of a minute, then transformers in float32

PROMPTS = [
    "def quicksort(items):\n    ",
    "The three primary colours are",
    "Write a haiku about a kiln.",
]
# model → whether each prompt runs raw, chat-templated or both
MODELS = {"qwen2.5-coder-0.5b-instruct": (False, True)}
NUM_TOKENS = 32


@pytest.fixture(scope="module", params=list(MODELS))
def qwen_gguf_path(request: pytest.FixtureRequest) -> Path:
    name = request.param
    home = Path(os.environ.get("KILN_HOME", "~/.cache/kiln")).expanduser()
    path = home / "models" / name / f"{name}-q4_k_m.gguf"
    if not path.is_file():
        pytest.skip(f"{name} not found at {path}; `make test` fetches it (`kiln pull {name}`)")
    return path


@pytest.fixture(scope="module")
def qwen_kiln(qwen_gguf_path: Path):
    import kiln

    return kiln.LLM(str(qwen_gguf_path), max_num_seqs=6, max_model_len=512, show_progress=False)


@pytest.fixture(scope="module")
def qwen_hf(qwen_gguf_path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        qwen_gguf_path.parent, gguf_file=qwen_gguf_path.name, dtype=torch.float32
    ).eval()


def _prompt_ids(llm, prompt: str, chat: bool) -> list[int]:
    tokenizer = llm.get_tokenizer()
    if not chat:
        return tokenizer.encode(prompt)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_default_path_is_tvm_with_the_k_quant_blocks(qwen_kiln) -> None:
    from kiln.llm import describe

    assert describe(qwen_kiln.artifact).startswith("backend tvm, target cpu")
    assert "quantization gguf" in describe(qwen_kiln.artifact)


def test_greedy_tokens_match_transformers(qwen_kiln, qwen_gguf_path: Path, qwen_hf, hf_greedy) -> None:
    import kiln

    eos_ids = qwen_kiln.get_tokenizer().eos_token_ids
    chats = MODELS[qwen_gguf_path.parent.name]
    cases = [(prompt, chat) for prompt in PROMPTS for chat in chats]
    prompts = [_prompt_ids(qwen_kiln, prompt, chat) for prompt, chat in cases]
    params = kiln.SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
    ours = [output.outputs[0].token_ids for output in qwen_kiln.generate(prompts, params)]
    for case, prompt_ids, tokens in zip(cases, prompts, ours, strict=True):
        assert tokens == hf_greedy(qwen_hf, prompt_ids, NUM_TOKENS, eos_ids), case
        assert len(tokens) == NUM_TOKENS or tokens[-1] in eos_ids
