"""The app in process on the tiny model: a dead engine makes /health and every request a 503 in OpenAI's
shape; a long prompt is tokenized off the event loop; the engine's refusals are 400s naming the field."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import pytest

from kiln.runtime.engine import LLMEngine
from kiln.runtime.sampling_params import SamplingParams

TIMEOUT_S = 30.0  # a request the dead engine forgot would wait forever: fail instead
LONG = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True}


class _AddFailsWhenArmed(LLMEngine):
    """Fault injection: once `armed`, admitting a request raises RuntimeError (a bug, not a refusal)."""

    armed = False

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        images: Sequence[Any] = (),
        lora_request: Any = None,
        pooling: Any = None,
    ) -> None:
        if self.armed:
            raise RuntimeError("injected fault admitting a request")
        super().add_request(request_id, prompt, params, priority, images, lora_request, pooling)


async def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


def _assert_engine_dead(error: dict, cause: str) -> None:
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and error["code"] == "engine_dead"
    assert cause in error["message"]


@pytest.mark.parametrize(
    ("fault", "cause"), [("step", "injected device fault"), ("command", "injected fault admitting")]
)
def test_a_dead_engine_fails_requests_in_flight_and_later_with_503(
    start_app, make_tiny_engine, fault: str, cause: str
) -> None:
    """A stream and a non-streamed request are in flight when the engine loop fails (in a step, or
    admitting a third request): the stream ends with an error event then [DONE], the others are 503s."""
    llm = make_tiny_engine(fail_at_step=10**9, engine_class=_AddFailsWhenArmed)
    server = start_app(llm)

    async def main() -> tuple[list[str], httpx.Response, httpx.Response | None]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as client:
            assert (await client.get("/health")).status_code == 200
            async with client.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as streamed:
                assert streamed.status_code == 200
                lines = streamed.aiter_lines()
                events = [await anext(line async for line in lines if line.startswith("data: "))]
                plain = asyncio.create_task(client.post("/v1/completions", json=LONG))
                await _until(lambda: len(llm.requests) == 2)
                third = None
                if fault == "step":
                    llm.executable.fail_at_step = llm.executable.calls + 1  # type: ignore[attr-defined]
                else:
                    llm.armed = True
                    third = await client.post("/v1/completions", json=LONG)
                events += [line async for line in lines if line.startswith("data: ")]
            return events, await plain, third

    events, plain, third = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    assert server.engine.dead is not None
    assert events[-1] == "data: [DONE]"
    _assert_engine_dead(json.loads(events[-2].removeprefix("data: "))["error"], cause)
    for response in (plain, third) if third is not None else (plain,):
        assert response.status_code == 503, response.text
        _assert_engine_dead(response.json()["error"], cause)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
    for stream in (False, True):
        later = httpx.post(f"{server.url}/v1/completions", json=LONG | {"stream": stream}, timeout=10)
        assert later.status_code == 503
        _assert_engine_dead(later.json()["error"], cause)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_health_is_answered_while_a_long_prompt_is_tokenized(start_app, path: str) -> None:
    """A ~2.4 MB prompt (under the body limit) takes the tokenizer a good part of a second; /health
    answers quickly all that while. The prompt is then refused as longer than the context."""
    server = start_app(max_request_bytes=8 * 2**20)
    text = " ".join(f"w{2 + i % 90}" for i in range(600_000))
    body: dict[str, object] = {"model": "tiny", "max_tokens": 1}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text

    async def main() -> tuple[httpx.Response, float, list[float]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as client:
            started = time.perf_counter()
            posted = asyncio.create_task(client.post(path, json=body))
            latencies = []
            while not posted.done():
                sent = time.perf_counter()
                assert (await client.get("/health")).status_code == 200
                latencies.append(time.perf_counter() - sent)
            response = await posted
            return response, time.perf_counter() - started, latencies

    response, elapsed, latencies = asyncio.run(main())
    if path == "/tokenize":
        assert response.status_code == 200 and response.json()["count"] == 600_000
    else:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["param"] == ("messages" if "chat" in path else "prompt")
    # On the event loop, tokenizing holds up every /health for nearly the whole request. (Loose bounds:
    # the machine may be busy.)
    assert len(latencies) >= 50, (len(latencies), elapsed)
    assert max(latencies) < elapsed / 2, (max(latencies), elapsed)


def test_a_prompt_over_the_step_budget_without_chunked_prefill_is_400(start_app, make_tiny_engine) -> None:
    server = start_app(make_tiny_engine(max_num_batched_tokens=16, enable_chunked_prefill=False))
    body = {"model": "tiny", "prompt": list(range(2, 22)), "max_tokens": 2}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and error["code"] is None
    assert "max_num_batched_tokens" in error["message"] and "chunked prefill" in error["message"]
    body["prompt"] = list(range(2, 18))
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT_S).status_code == 200
