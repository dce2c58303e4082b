"""SIGTERM: the server stops accepting, finishes the request in flight, and exits 0."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

pytestmark = pytest.mark.slow  # starts its own SmolLM2 server (~10 s)


def test_sigterm_finishes_the_request_in_flight_then_exits_0(start_server) -> None:
    server = start_server("--max-model-len", "256")
    body = {
        "model": server.model,
        "prompt": "Count to twenty:",
        "max_tokens": 12,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        server.process.send_signal(signal.SIGTERM)
        assert _stops_accepting(server.url)
        rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(first.removeprefix("data: ")), *(json.loads(line) for line in rest[:-1])]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert server.process.wait(timeout=60) == 0


def _stops_accepting(url: str, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=5)
        except httpx.ConnectError:
            return True
        time.sleep(0.1)
    return False
