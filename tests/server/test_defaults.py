"""Fields a request leaves out take OpenAI's (and vLLM's) defaults; docs/server.md "Defaults" lists them
and where Kiln differs."""

from __future__ import annotations

from typing import Any

import httpx

from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import LLMEngine
from tests.server.conftest import TINY_MODEL_NAME

CONTEXT = 48


def test_a_completion_without_max_tokens_stops_at_16(start_app) -> None:
    server = start_app()
    body = {"model": TINY_MODEL_NAME, "prompt": "w3 w4", "ignore_eos": True}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert reply["usage"]["completion_tokens"] == 16
    assert reply["choices"][0]["finish_reason"] == "length"


def _engine(tiny_model: Any, num_blocks: int) -> LLMEngine:
    """The tiny model with a 48-token context (short runs) and `num_blocks` blocks of 4."""
    executable, tokenizer = tiny_model
    config = EngineConfig(block_size=4, num_blocks=num_blocks)
    return LLMEngine(executable, tokenizer, "tiny", CONTEXT, config)


def test_a_chat_completion_without_a_limit_runs_to_the_context(start_app, tiny_model) -> None:
    server = start_app(_engine(tiny_model, num_blocks=16))  # room for a whole context
    body = {"messages": [{"role": "user", "content": "w3 w4"}], "ignore_eos": True}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    reply = response.json()
    usage = reply["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == server.engine.max_model_len == CONTEXT
    assert reply["choices"][0]["finish_reason"] == "length"


def test_without_a_limit_a_chat_stops_where_a_smaller_kv_cache_ends(start_app, tiny_model) -> None:
    server = start_app(_engine(tiny_model, num_blocks=9))  # 8 usable blocks of 4: 32 tokens
    body = {"messages": [{"role": "user", "content": "w3 w4"}], "ignore_eos": True}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"] == 32
