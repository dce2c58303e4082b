"""Gemma 3 270M, the Q4_K_M GGUF from the package registry, on the default path (`kiln.LLM(model)`: TVM
for this CPU, the GGUF's own blocks) against llama.cpp on the same file. Not transformers: transformers
loads this gemma3 GGUF into a model that emits garbage. llama.cpp's greedy tokens, top-2 log-probabilities
and tokenizations are a fixture (tests/fixtures/gemma3_270m_llama_cpp.json; `made_by` says how it was
recorded, with scripts/record_llama_cpp_greedy.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # an 18-layer model with a 262,144-token vocabulary: a compile of ~20 s

NAME = "gemma-3-270m"
FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "gemma3_270m_llama_cpp.json"
NEAR_TIE = 0.1  # nats between llama.cpp's two most likely tokens: past one, either may be picked


@pytest.fixture(scope="module")
def llama_cpp() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def gemma(llama_cpp) -> Any:
    home = Path(os.environ.get("KILN_HOME", "~/.cache/kiln")).expanduser()
    path = home / "models" / NAME / "gemma-3-270m-q4_k_m.gguf"
    if not path.is_file():
        pytest.skip(f"{NAME} not found at {path}; `make test` fetches it (`kiln pull {NAME}`)")
    import kiln

    return kiln.LLM(str(path), max_num_seqs=4, max_model_len=512, show_progress=False)


def test_the_default_path_is_tvm_with_the_gguf_blocks(gemma) -> None:
    from kiln.llm import describe

    assert describe(gemma.artifact).startswith("backend tvm, target cpu")
    assert "quantization gguf" in describe(gemma.artifact)


def test_tokenizer_matches_llama_cpp(gemma, llama_cpp) -> None:
    tokenizer = gemma.get_tokenizer()
    cases = [(p["prompt"], p["prompt_tokens"]) for p in llama_cpp["prompts"]]
    cases += [(t["text"], t["tokens"]) for t in llama_cpp["tokenized"]]
    for text, tokens in cases:
        assert tokenizer.encode(text) == tokens, text
    for prompt in llama_cpp["prompts"]:
        assert tokenizer.decode(prompt["tokens"]) == prompt["text"], prompt["prompt"]


def _checked_length(top2_logprobs: list[list[float]]) -> int:
    """Positions before llama.cpp's first near-tie (its greedy pick there is no better than a coin)."""
    for position, (first, second) in enumerate(top2_logprobs):
        if first - second < NEAR_TIE:
            return position
    return len(top2_logprobs)


def test_greedy_tokens_match_llama_cpp_up_to_the_first_near_tie(gemma, llama_cpp) -> None:
    import kiln

    cases = llama_cpp["prompts"]
    params = kiln.SamplingParams(temperature=0, max_tokens=len(cases[0]["tokens"]), ignore_eos=True)
    ours = gemma.generate([case["prompt_tokens"] for case in cases], params)
    for case, output in zip(cases, ours, strict=True):
        length = _checked_length(case["top2_logprobs"])
        assert length >= 10, case["prompt"]  # the fixture checks something
        assert output.outputs[0].token_ids[:length] == case["tokens"][:length], case["prompt"]
