"""run_server: on SIGTERM a request that will not finish soon holds the server up for at most
shutdown_timeout seconds. In process, on the tiny model with a slow step; the SIGTERM is this
process's own, taken by uvicorn's handler while the server runs."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from kiln.runtime.async_engine import AsyncEngine
from kiln.server.run import run_server

STEP_DELAY_S = 0.2  # the request below needs 200 steps: 40 s


def test_sigterm_cancels_a_request_still_running_after_shutdown_timeout(
    make_tiny_engine, unused_port
) -> None:
    engine = AsyncEngine(make_tiny_engine(step_delay_s=STEP_DELAY_S))
    url = f"http://127.0.0.1:{unused_port}"
    seen: dict[str, object] = {}

    def client() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 200, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                lines = response.iter_lines()
                seen["first"] = next(line for line in lines if line.startswith("data: "))
                seen["signalled_at"] = time.monotonic()
                os.kill(os.getpid(), signal.SIGTERM)
                seen["rest"] = list(lines)
        except httpx.HTTPError as error:  # the server cut the request off
            seen["error"] = error

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    run_server(engine, served_model_name="tiny", port=unused_port, log_level="warning", shutdown_timeout=1.0)
    stopped_at = time.monotonic()
    thread.join(30)
    assert "first" in seen, seen
    assert stopped_at - seen["signalled_at"] < 10  # type: ignore[operator]
    assert engine.dead is not None  # shut down
