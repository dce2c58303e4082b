"""`kiln serve A B C`: several models from one port (server/router.py), each loaded on its first request.

The models are SmolLM2's GGUF served under three names (NAME=MODEL): each loads its own engine from the
artifact the session's `api_server` compiled into the cache, in well under a second."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from kiln.runtime.async_engine import AsyncEngine
from kiln.server.app import create_app
from kiln.server.router import ModelEntry, ModelRouter, ServedModel
from tests.server.conftest import START_TIMEOUT_S, ServerProcess, free_port

FRANCE = "The capital of France is"
GREEDY = {"max_tokens": 32, "temperature": 0}


class RouterProcess(ServerProcess):
    """`python -m kiln.cli serve MODEL ...` with several models: healthy at once, nothing loaded yet."""

    def __init__(self, *models: str, flags: tuple[str, ...] = (), api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        command = [sys.executable, "-m", "kiln.cli", "serve", *models, "--port", str(self.port)]
        command += ["--uvicorn-log-level", "warning", "--max-model-len", "256", *flags]
        command += ["--api-key", api_key] if api_key is not None else []
        self._log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, text=True)
        self._wait_until_healthy(START_TIMEOUT_S)

    def rss_bytes(self) -> int:
        """The server process's resident memory (VmRSS)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def cards(self) -> dict[str, dict[str, Any]]:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        cards = httpx.get(f"{self.url}/v1/models", headers=auth, timeout=10).json()["data"]
        return {card["id"]: card for card in cards}

    def statuses(self) -> dict[str, str]:
        return {name: card["status"]["value"] for name, card in self.cards().items()}

    def complete(self, model: str) -> str:
        out = self.client().completions.create(model=model, prompt=FRANCE, **GREEDY)
        return out.choices[0].text


@pytest.fixture
def start_router(api_server, smollm2_gguf_path: Path) -> Iterator[Callable[..., RouterProcess]]:
    """`start(*flags, models=("a", "b", "c"))`: each name serves the SmolLM2 GGUF (which `api_server`
    compiled into the cache); a name given as NAME=MODEL is served as it is."""
    started: list[RouterProcess] = []

    def start(
        *flags: str, models: tuple[str, ...] = ("a", "b", "c"), api_key: str | None = None
    ) -> RouterProcess:
        specs = [m if "=" in m else f"{m}={smollm2_gguf_path}" for m in models]
        started.append(RouterProcess(*specs, flags=flags, api_key=api_key))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.mark.slow
def test_a_third_model_unloads_the_least_recently_used_and_gives_back_its_memory(start_router) -> None:
    server = start_router("--max-loaded-models", "2", api_key="sesame")
    assert server.statuses() == {"a": "unloaded", "b": "unloaded", "c": "unloaded"}  # nothing loads at start
    keyless = httpx.post(f"{server.url}/v1/completions", json={"model": "a", "prompt": FRANCE}, timeout=10)
    assert keyless.status_code == 401 and server.statuses()["a"] == "unloaded"
    alone = server.complete("a")
    one_loaded = server.rss_bytes()
    assert server.complete("b") == alone
    two_loaded = server.rss_bytes()
    assert server.statuses() == {"a": "loaded", "b": "loaded", "c": "unloaded"}
    card = server.cards()["a"]
    assert card["max_model_len"] == 256 and card["root"] == "a"  # a loaded model's card, as one model's

    assert server.complete("c") == alone  # a, the least recently used, makes room
    assert server.statuses() == {"a": "unloaded", "b": "loaded", "c": "loaded"}
    assert "kiln: unloaded a" in server.log()
    share = two_loaded - one_loaded  # what one more loaded (and used) model holds: ~150 MiB
    assert share > 50 * 2**20, share
    # without the unload's memory back the server would hold three models' worth now: it holds two's
    assert server.rss_bytes() < two_loaded + share / 2, (one_loaded, two_loaded, server.rss_bytes())

    server.complete("b")  # now c is the least recently used
    assert server.complete("a") == alone
    assert server.statuses() == {"a": "loaded", "b": "loaded", "c": "unloaded"}
    libraries = {line.rsplit("/", 1)[-1].strip() for line in Path(f"/proc/{server.process.pid}/maps").open()}
    assert not {name for name in libraries if name.startswith(("libtorch", "libtvm_compiler"))}
    assert server.stop() == 0  # SIGTERM closes every loaded model


@pytest.mark.slow
def test_two_models_stream_at_once_and_bad_requests_are_refused(start_router, tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a GGUF file")
    server = start_router(models=("a", "b", f"broken={broken}"))
    with ThreadPoolExecutor(3) as pool:  # first requests at once: they wait for one load
        assert len(set(pool.map(server.complete, "aaa"))) == 1
    assert server.log().count("kiln: loaded a ") == 1
    alone = {name: server.complete(name) for name in ("a", "b")}

    async def read(chunks: Any) -> str:
        return "".join([chunk.choices[0].text async for chunk in chunks if chunk.choices])

    async def both() -> tuple[str, str, str]:
        """a's stream is opened and its first chunk read; b's is then read whole while a's is open (a
        router that served one model at a time would hang here); then the rest of a's."""
        async with server.async_client() as client:
            stream_a = await client.completions.create(model="a", prompt=FRANCE, stream=True, **GREEDY)
            first = await anext(aiter(stream_a))
            stream_b = await client.completions.create(model="b", prompt=FRANCE, stream=True, **GREEDY)
            text_b = await asyncio.wait_for(read(stream_b), 120)
            return first.choices[0].text, await read(stream_a), text_b

    first_a, rest_a, text_b = asyncio.run(both())
    assert [first_a + rest_a, text_b] == [alone["a"], alone["b"]]

    client = server.client()
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="nope", prompt=FRANCE, **GREEDY)
    assert unknown.value.body["code"] == "model_not_found" and unknown.value.body["param"] == "model"
    no_model = httpx.post(f"{server.url}/v1/completions", json={"prompt": FRANCE}, timeout=10)
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
    assert "a, b, broken" in no_model.json()["error"]["message"]

    with pytest.raises(openai.InternalServerError) as failed:
        client.completions.create(model="broken", prompt=FRANCE, **GREEDY)
    assert failed.value.body["code"] == "model_load_failed" and "not a readable GGUF" in failed.value.message
    cards = {card["id"]: card for card in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]}
    status = cards["broken"]["status"]
    assert status["value"] == "unloaded" and status["failed"] and "not a readable GGUF" in status["message"]
    assert cards["a"]["status"] == {"value": "loaded"}
    assert server.complete("a") == alone["a"]  # the others keep serving
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'kiln:generation_tokens_total{model_name="a"}' in metrics
    assert 'kiln:generation_tokens_total{model_name="b"}' in metrics


def test_served_model_name_is_refused_with_several_models(smollm2_gguf_path: Path) -> None:
    command = [sys.executable, "-m", "kiln.cli", "serve", f"a={smollm2_gguf_path}", f"b={smollm2_gguf_path}"]
    done = subprocess.run([*command, "--served-model-name", "x"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--served-model-name serves one model" in done.stderr


def test_a_model_waits_for_room_then_is_a_503_while_every_loaded_model_stays_busy(
    make_tiny_engine, unused_port
) -> None:
    """In process, on the tiny model: with one model loaded at most, y waits for x's stream to end, and
    is a 503 (OpenAI's shape) once the router's wait for room runs out."""

    def load(entry: ModelEntry) -> ServedModel:
        engine = AsyncEngine(make_tiny_engine(step_delay_s=0.02))
        return ServedModel(create_app(engine, entry.name, None, None), engine, engine.shutdown)

    router = ModelRouter(
        [ModelEntry("x", "tiny"), ModelEntry("y", "tiny")], load, max_loaded_models=1, busy_timeout_s=0.5
    )
    server = uvicorn.Server(uvicorn.Config(router, port=unused_port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{unused_port}"
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the router did not start"
            time.sleep(0.01)
        body = {"model": "x", "prompt": [5, 6], "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as streaming:
            lines = streaming.iter_lines()  # held: its generator, once collected, would close the stream
            next(line for line in lines if line.startswith("data: "))
            busy = httpx.post(f"{url}/v1/completions", json={"model": "y", "prompt": [5]}, timeout=30)
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "overloaded"
        router.busy_timeout_s = 60  # x's end (its client left) reaches the router when x's app sees it
        short = {"model": "y", "prompt": [5], "max_tokens": 2}
        done = httpx.post(f"{url}/v1/completions", json=short, timeout=30)
        assert done.status_code == 200  # x's client left: x made room
        cards = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert [card["status"]["value"] for card in cards] == ["unloaded", "loaded"]
    finally:
        server.should_exit = True
        thread.join(30)
        router.close()
