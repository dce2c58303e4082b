"""`kiln serve --tensor-parallel-size 3` on SmolLM2 (reference backend, float32): the OpenAI routes answer
with the tokens of one process; a worker killed mid-stream ends the stream with an error event, turns
/health into 503, and SIGTERM still stops the server cleanly."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest

import kiln

pytestmark = pytest.mark.slow

TP_ARGS = ("--backend", "reference", "--quantization", "none", "--max-model-len", "512")


def _workers(pid: int) -> list[int]:
    """The server's spawned rank processes (multiprocessing's spawn children)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return [c for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]


def test_tp3_server_answers_as_one_process_and_survives_a_dead_worker(
    start_server, smollm2_gguf_path
) -> None:
    server = start_server(*TP_ARGS, "--tensor-parallel-size", "3")
    assert "tensor-parallel 3" in server.log()
    prompt = "The capital of France is"
    client = server.client()
    completion = client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0)
    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model=server.model, messages=messages, max_tokens=8, temperature=0)
    streamed = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        == chat.choices[0].message.content
    )
    one = kiln.LLM(str(smollm2_gguf_path), backend="reference", quantization="none", show_progress=False)
    alone = one.generate(prompt, kiln.SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert completion.choices[0].text == alone

    workers = _workers(server.process.pid)
    assert len(workers) == 2
    body = {"model": server.model, "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line)
            if len(events) == 3:
                os.kill(workers[0], signal.SIGKILL)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert "tensor-parallel rank" in error["message"] and "exited (code -9)" in error["message"], error
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
    assert server.stop() == 0
