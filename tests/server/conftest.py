"""The real server as a user runs it: `python -m kiln.cli serve <gguf>` in a subprocess on a free port of
127.0.0.1, SmolLM2 with the defaults a user gets (TVM for this CPU with the GGUF's own blocks, compiled
once into the cache). A start loads the model in seconds (the first one compiles it, ~20 s), so one
server serves a whole session (`api_server`) and modules start their own only for flags they need.

`start_app` serves the app in this process instead, on the tiny random-weight model: real uvicorn on a
free port in a thread, started in well under a second, for tests of the server's own behaviour."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kiln.runtime.async_engine import AsyncEngine
from kiln.runtime.engine import LLMEngine
from kiln.server.app import create_app

MODEL_NAME = "smollm2"
START_TIMEOUT_S = 180.0
# a first start of a 0.5B GGUF compiles it: 2.5 min on a fast day, over 3 on a slow shared 2-core VM
COMPILING_START_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(
        self,
        gguf: Path,
        *args: str,
        api_key: str | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        env: dict[str, str] | None = None,
        wrapper: tuple[str, ...] = (),
    ) -> None:
        """`wrapper`: a command that runs the server's command line (its arguments appended)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.model = MODEL_NAME
        command = [*wrapper, sys.executable, "-m", "kiln.cli", "serve", str(gguf), "--port", str(self.port)]
        command += ["--served-model-name", MODEL_NAME, "--uvicorn-log-level", "warning", *args]
        if api_key is not None:
            command += ["--api-key", api_key]
        self._log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, text=True, env=env
        )
        self._wait_until_healthy(start_timeout_s)

    def _wait_until_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kiln serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"kiln serve was not healthy after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def client(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, **kwargs
        )

    def async_client(self, **kwargs: object) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, **kwargs
        )

    def post(self, path: str, headers: dict[str, str] | None = None, **kwargs: object) -> httpx.Response:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        headers = auth | (headers or {})
        return httpx.post(f"{self.url}{path}", headers=headers, timeout=60, **kwargs)  # type: ignore[arg-type]

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name, labels other than model_name folded into the name."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
                suffix = "".join(f"{{{k}={v}}}" for k, v in sorted(labels.items()))
                samples[sample.name + suffix] = sample.value
        return samples

    def wait_for_metrics(
        self, ok: Callable[[dict[str, float]], bool], timeout: float = 30.0
    ) -> dict[str, float]:
        """The metrics once `ok` holds of them; failing, with the last ones, after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            samples = self.metrics()
            if ok(samples):
                return samples
            assert time.monotonic() < deadline, f"the metrics did not come to it in {timeout} s: {samples}"
            time.sleep(0.05)

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


@pytest.fixture(scope="session")
def start_server(smollm2_gguf_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start `kiln serve` on SmolLM2 with extra flags; every server started is stopped at the end."""
    started: list[ServerProcess] = []

    def start(
        *args: str,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        wrapper: tuple[str, ...] = (),
    ) -> ServerProcess:
        server = ServerProcess(
            smollm2_gguf_path,
            *args,
            api_key=api_key,
            env=env,
            start_timeout_s=start_timeout_s,
            wrapper=wrapper,
        )
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def api_server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    """The shared server: default flags but a 1024-token context, so a too-long prompt is cheap."""
    return start_server("--max-model-len", "1024")


@pytest.fixture(scope="session")
def qwen_server() -> Iterator[ServerProcess]:
    """`kiln serve` on Qwen2.5-Coder-0.5B-Instruct with tool calling on (the hermes parser)."""
    from kiln.frontend.pull import kiln_home

    name = "qwen2.5-coder-0.5b-instruct"
    path = kiln_home() / "models" / name / f"{name}-q4_k_m.gguf"
    if not path.is_file():
        pytest.skip(f"{name} not found at {path}; `make test` fetches it (`kiln pull {name}`)")
    server = ServerProcess(
        path,
        "--max-model-len",
        "2048",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        start_timeout_s=COMPILING_START_TIMEOUT_S,
    )
    yield server
    server.stop()


TINY_MODEL_NAME = "tiny"


@pytest.fixture
def unused_port() -> int:
    return free_port()


@dataclass
class AppServer:
    url: str
    engine: AsyncEngine


@pytest.fixture
def start_app(make_tiny_engine) -> Iterator[Callable[..., AppServer]]:
    """`start(llm_engine=None, api_key=None, max_waiting=None, **create_app_keywords)`: the app on an
    AsyncEngine over `llm_engine` (default: a tiny engine), served as TINY_MODEL_NAME. Every server and
    engine started is stopped at the end."""
    started: list[tuple[uvicorn.Server, threading.Thread, AsyncEngine]] = []

    def start(
        llm_engine: LLMEngine | None = None,
        api_key: str | None = None,
        max_waiting: int | None = None,
        **keywords: Any,
    ) -> AppServer:
        engine = AsyncEngine(llm_engine or make_tiny_engine())
        try:
            app = create_app(engine, TINY_MODEL_NAME, api_key, max_waiting, **keywords)
        except Exception:
            engine.shutdown()
            raise
        port = free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
        started.append((server, thread, engine))
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.01)
        return AppServer(f"http://127.0.0.1:{port}", engine)

    yield start
    for server, thread, engine in started:
        server.should_exit = True
        thread.join(30)
        engine.shutdown()
