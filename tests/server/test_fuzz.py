"""Fuzzing every POST route of the tiny in-process app: 10,000 seeded mutations of valid bodies (see
fuzz_bodies.py), 16 in flight, must all be answered without a 5xx; every 4xx in its API's error shape;
every stream read to its end, ending as its API ends one (an error inside it an error event); every valid
body (a seed the tiny server serves) answered 2xx, and on each route at least its share of all bodies
(`Endpoint.min_success`: a server refusing everything in good shape fails); and the server healthy and
answering afterwards. A failure lists the first offending requests and the server's tracebacks;
`generate(SEED, NUM_BODIES)` gives the same bodies again."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from tests.server.fuzz_bodies import ENDPOINTS, Case, Endpoint, generate

SEED = 20_250_611
NUM_BODIES = 10_000
IN_FLIGHT = 16
REQUEST_TIMEOUT_S = 60.0
SHOWN_FAILURES = 5

OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}
STREAM_ENDS = {
    "/v1/completions": {"[DONE]"},
    "/v1/chat/completions": {"[DONE]"},
    "/v1/responses": {"response.completed", "response.incomplete", "response.failed", "error"},
    "/v1/messages": {"message_stop", "error"},
}

STREAM_ERROR_MARKS = ('"error": {', '"error":{', "event: error", "event: response.failed")


@dataclass
class Outcome:
    case: Case
    status: int | None  # None: no response
    text: str
    problem: str | None  # why this request fails the test


def openai_error_problem(body: Any) -> str | None:
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return "not an OpenAI error body"
    error = body["error"]
    if set(error) != OPENAI_ERROR_KEYS:
        return f"error keys {sorted(error)}, not {sorted(OPENAI_ERROR_KEYS)}"
    if not (isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)):
        return "error.message and error.type must be strings"
    if not all(error[key] is None or isinstance(error[key], str) for key in ("param", "code")):
        return "error.param and error.code must be strings or null"
    return None


def anthropic_error_problem(body: Any) -> str | None:
    if not isinstance(body, dict) or set(body) != {"type", "error"} or body["type"] != "error":
        return "not an Anthropic error body"
    error = body["error"]
    if not isinstance(error, dict) or set(error) != {"type", "message"}:
        return "Anthropic error must be {type, message}"
    if not (isinstance(error["type"], str) and isinstance(error["message"], str) and error["message"]):
        return "error.type and error.message must be strings"
    return None


def error_problem(endpoint: Endpoint, text: str) -> str | None:
    try:
        body = json.loads(text)
    except ValueError:
        return "error body is not JSON"
    return anthropic_error_problem(body) if endpoint.anthropic else openai_error_problem(body)


def stream_problem(endpoint: Endpoint, text: str) -> str | None:
    """What is wrong with a 200 stream's whole body: an event that is no JSON, an error event not in the
    API's shape or one a 5xx would have been, or an end other than the API's."""
    last = None
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        data = lines.get("data")
        if data is None:
            return f"an event without data: {block[:200]!r}"
        if data == "[DONE]":
            last = data
            continue
        try:
            event = json.loads(data)
        except ValueError:
            return f"an event whose data is not JSON: {data[:200]!r}"
        last = lines.get("event", "data")
        if "event" in lines and event.get("type") != last:
            return f"event {last!r} holds data of type {event.get('type')!r}"
        if last == "error" or (last == "data" and "error" in event):
            problem = error_problem(endpoint, data)
            kind = event["error"].get("type") if isinstance(event.get("error"), dict) else None
            if problem is None and kind in ("server_error", "api_error"):
                problem = f"an error event a 5xx would have been: {data[:300]}"
            if problem is not None:
                return problem
    if last not in STREAM_ENDS[endpoint.path]:
        return f"the stream ends with {last!r}, not one of {sorted(STREAM_ENDS[endpoint.path])}"
    return None


async def send(client: httpx.AsyncClient, case: Case) -> Outcome:
    headers = {"content-type": case.content_type} if case.content_type else {}
    try:
        async with client.stream("POST", case.endpoint.path, content=case.content, headers=headers) as reply:
            text = (await reply.aread()).decode("utf-8", errors="replace")
    except httpx.HTTPError as error:
        return Outcome(case, None, "", f"no complete response: {type(error).__name__}: {error}")
    status, problem = reply.status_code, None
    if status >= 500:
        problem = f"status {status}"
    elif status >= 400:
        problem = error_problem(case.endpoint, text)
    elif reply.headers.get("content-type", "").startswith("text/event-stream"):
        problem = stream_problem(case.endpoint, text)
    elif case.stream:
        problem = "asked for a stream, answered without one"
    return Outcome(case, status, text, problem)


def new_client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=1), timeout=REQUEST_TIMEOUT_S)


async def send_all(url: str, cases: list[Case]) -> list[Outcome]:
    """Each case sent by one of IN_FLIGHT workers, each with its own client and connection (one pool of
    them all costs more CPU than the server's answers)."""
    queue = iter(cases)  # shared: each case is taken by one worker
    outcomes: list[Outcome] = []

    async def worker() -> None:
        client = new_client(url)
        try:
            for case in queue:
                outcome = await send(client, case)
                outcomes.append(outcome)
                if outcome.status is None or outcome.status >= 500:  # uvicorn closes the connection
                    await client.aclose()
                    client = new_client(url)
        finally:
            await client.aclose()

    await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
    return outcomes


class _Collected(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


@contextmanager
def server_errors() -> Iterator[list[str]]:
    """The server's error logs (with their tracebacks) while inside: uvicorn's for a failed stream, the
    app's for an unexpected exception."""
    handler = _Collected()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "kiln")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def report(failures: list[Outcome], logged: list[str], what: str = "failed") -> str:
    by_route = Counter(f"{o.case.endpoint.path} {o.status}" for o in failures)
    lines = [f"{len(failures)} of {NUM_BODIES} requests {what} ({dict(by_route)}); the first:"]
    for outcome in failures[:SHOWN_FAILURES]:
        case = outcome.case
        lines += [
            f"- POST {case.endpoint.path} ({case.kind}, content-type {case.content_type!r}) -> "
            f"{outcome.status}: {outcome.problem or what}",
            f"  body: {case.content[:800]!r}",
            f"  response: {outcome.text[:600]}",
        ]
    # each traceback's first line and its end, where the error is
    lines += ["server log:", *(_shortened(record) for record in logged[:3])]
    return "\n".join(lines)


def succeeded(outcome: Outcome) -> bool:
    return outcome.status is not None and 200 <= outcome.status < 300


def _shortened(record: str, keep: int = 2500) -> str:
    if len(record) <= 2 * keep:
        return record
    return f"{record[:keep]}\n  [...]\n{record[-keep:]}"


def test_fuzzed_bodies_to_every_post_route_get_no_5xx(start_app, make_tiny_engine) -> None:
    # a batch as wide as the requests in flight, and the KV cache for it: generation keeps up
    engine = make_tiny_engine(num_blocks=512, max_num_seqs=IN_FLIGHT * 2, max_num_batched_tokens=512)
    server = start_app(engine, allow_lora_updates=True)
    cases = generate(SEED, NUM_BODIES)
    with server_errors() as logged:
        started = time.monotonic()
        outcomes = asyncio.run(send_all(server.url, cases))
        elapsed = time.monotonic() - started
    statuses = Counter(o.status for o in outcomes)
    streams = [o for o in outcomes if o.case.stream and o.status == 200]
    stream_errors = sum(any(e in o.text for e in STREAM_ERROR_MARKS) for o in streams)
    print(
        f"\n{len(outcomes)} bodies in {elapsed:.1f} s: {dict(statuses)}; {len(streams)} streams read to "
        f"the end, {stream_errors} of them with an error event"
    )
    assert len(outcomes) == NUM_BODIES
    failures = [o for o in outcomes if o.problem is not None]
    assert not failures, report(failures, logged)
    refused = [o for o in outcomes if o.case.valid and not succeeded(o)]
    assert not refused, report(refused, logged, "valid, not answered 2xx")
    sent = Counter(o.case.endpoint.path for o in outcomes)
    served = Counter(o.case.endpoint.path for o in outcomes if succeeded(o))
    shares = {e.path: served[e.path] / sent[e.path] for e in ENDPOINTS}
    print("2xx share by route: " + ", ".join(f"{path} {share:.2f}" for path, share in shares.items()))
    low = {
        e.path: (round(shares[e.path], 3), e.min_success) for e in ENDPOINTS if shares[e.path] < e.min_success
    }
    assert not low, f"routes answering too few bodies 2xx, (share, least): {low}"
    # every route that serves some bodies had valid ones sent
    assert {o.case.endpoint.path for o in outcomes if o.case.valid} == {
        e.path for e in ENDPOINTS if e.min_success
    }
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    normal = {"model": "tiny", "messages": [{"role": "user", "content": "w2 w3"}], "max_tokens": 3}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=normal, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3
