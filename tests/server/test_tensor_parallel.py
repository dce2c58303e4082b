"""`kiln serve --tensor-parallel-size 3` on SmolLM2 on the documented default path (TVM, the GGUF's Q4_1
blocks split between the ranks) answers greedy requests with the tokens of the one-process server. On
the reference backend (float32): the OpenAI routes answer with the tokens of one process; a worker
killed mid-stream ends the stream with an error event, turns /health into 503, and SIGTERM still stops
the server cleanly. The same model compiled at TP 3 and served by three torchrun "nodes" (each its own
agent, joined over 127.0.0.1) answers the same, and stopping node 0 stops the others cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import kiln

pytestmark = pytest.mark.slow

TP_ARGS = ("--backend", "reference", "--quantization", "none", "--max-model-len", "512")


def test_tp3_on_the_default_path_tvm_with_gguf_blocks_answers_as_one_process(
    start_server, api_server
) -> None:
    server = start_server("--max-model-len", "512", "--tensor-parallel-size", "3", start_timeout_s=600)
    assert "backend tvm" in server.log() and "quantization gguf" in server.log(), server.log()
    assert "tensor-parallel 3" in server.log()
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}
        answers = [one.client().completions.create(model=one.model, **body) for one in (server, api_server)]
        texts = [answer.choices[0].text for answer in answers]
        assert texts[0] == texts[1], (prompt, texts)
    assert server.stop() == 0


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, nodes: list[subprocess.Popen[bytes]], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(node.poll() is not None for node in nodes):
            raise AssertionError(f"a torchrun node exited: {[node.returncode for node in nodes]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"not healthy after {timeout} s")


def test_tp3_artifact_served_by_three_torchrun_nodes(smollm2_gguf_path, tmp_path: Path) -> None:
    artifact = tmp_path / "tp3"
    compile_args = ["compile", str(smollm2_gguf_path), *TP_ARGS, "--tensor-parallel-size", "3"]
    subprocess.run(
        [sys.executable, "-m", "kiln.cli", *compile_args, "-o", str(artifact), "--quiet"], check=True
    )
    torchrun = Path(sys.executable).with_name("torchrun")
    master_port, port = _free_port(), _free_port()
    logs = [(tmp_path / f"node{n}.log").open("wb") for n in range(3)]
    serve = ["-m", "kiln.cli", "serve", str(artifact), "--port", str(port), "--served-model-name", "smollm2"]
    launch = [str(torchrun), "--nnodes", "3", "--nproc-per-node", "1", "--master-addr", "127.0.0.1"]
    nodes = [
        subprocess.Popen(
            [*launch, "--master-port", str(master_port), "--node-rank", str(node), *serve],
            stdout=logs[node],
            stderr=subprocess.STDOUT,
        )
        for node in range(3)
    ]
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, nodes)
        prompt = "The capital of France is"
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        completion = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        one = kiln.LLM(str(smollm2_gguf_path), backend="reference", quantization="none", show_progress=False)
        alone = one.generate(prompt, kiln.SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
        assert completion["choices"][0]["text"] == alone

        nodes[0].send_signal(signal.SIGTERM)  # torchrun stops its rank 0; rank 0 stops the others
        assert [node.wait(90) for node in nodes[1:]] == [0, 0]
        nodes[0].wait(60)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
