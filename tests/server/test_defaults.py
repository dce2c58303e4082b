"""Fields a request leaves out take OpenAI's (and vLLM's) defaults; docs/server.md "Defaults" lists them
and where Kiln differs."""

from __future__ import annotations

import httpx

from tests.server.conftest import TINY_MODEL_NAME


def test_a_completion_without_max_tokens_stops_at_16(start_app) -> None:
    server = start_app()
    body = {"model": TINY_MODEL_NAME, "prompt": "w3 w4", "ignore_eos": True}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert reply["usage"]["completion_tokens"] == 16
    assert reply["choices"][0]["finish_reason"] == "length"


def test_a_chat_completion_without_a_limit_runs_to_the_context(start_app, make_tiny_engine) -> None:
    server = start_app(make_tiny_engine(num_blocks=80))  # room for a whole context
    body = {"messages": [{"role": "user", "content": "w3 w4"}], "ignore_eos": True}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    reply = response.json()
    usage = reply["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == server.engine.max_model_len
    assert reply["choices"][0]["finish_reason"] == "length"


def test_without_a_limit_a_chat_stops_where_a_smaller_kv_cache_ends(start_app, make_tiny_engine) -> None:
    server = start_app(make_tiny_engine(num_blocks=32))  # 31 usable blocks of 4: 124 tokens
    body = {"messages": [{"role": "user", "content": "w3 w4"}], "ignore_eos": True}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"] == 124
