"""Live weight updates on a real `kiln serve --enable-weight-updates` (the tiny random Llama of
examples/rl_loop.py, reference backend): from disk and from a trainer over gloo, each answer naming its
weight version; the faults (a wrong name, a wrong shape, a trainer killed mid-broadcast) leave the old
weights serving; an update while 16 streams decode gives each stream one version; pause, resume, sleep
and wake-up; the routes only with the flag and behind the API key."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import transformers

from kiln.weight_sync import WeightSync, WeightSyncError
from tests.conftest import load_script
from tests.server.conftest import ServerProcess

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"
PROMPTS = [[1 + i, 5 + i, 9, 13 + i] for i in range(20)]
MAX_TOKENS = 12


def rl_loop() -> Any:
    return load_script(EXAMPLE)


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("weights") / "policy"
    return folder, rl_loop().make_model(folder)


@pytest.fixture(scope="module")
def server(policy: tuple[Path, Any]) -> Iterator[ServerProcess]:
    process = ServerProcess(
        policy[0], "--backend", "reference", "--quantization", "none", "--enable-weight-updates"
    )
    yield process
    process.stop()


def nudged(model: Any, seed: int) -> Any:
    """A copy of the model, moved as a training step would."""
    copy = transformers.LlamaForCausalLM(model.config).eval()
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in copy.parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=generator))
    return copy


def greedy(model: Any, prompt: list[int], num_tokens: int) -> list[int]:
    return rl_loop().greedy(model, prompt, num_tokens)


def completion(server: ServerProcess, prompt: list[int], **fields: Any) -> tuple[list[int], int, str]:
    """(token ids, weight version, finish reason) of a greedy completion."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    body |= {"skip_special_tokens": False, "ignore_eos": True, **fields}
    response = server.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    ids = rl_loop().token_ids(choice["text"])
    return ids, int(response.headers["kiln-weight-version"]), choice["finish_reason"]


def version(server: ServerProcess) -> tuple[int, str]:
    card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    return card["weight_version"], card["weight_source"]


def test_updates_from_disk_and_from_a_trainer_and_the_faults_that_leave_the_old_weights(
    server: ServerProcess, policy: tuple[Path, Any], tmp_path: Path
) -> None:
    _, model = policy
    start, _ = version(server)
    stepped = nudged(model, 1)
    stepped.save_pretrained(tmp_path / "stepped")
    answer = server.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "stepped")})
    assert answer.status_code == 200, answer.text
    assert answer.json()["weight_version"] == start + 1
    assert version(server) == (start + 1, f"disk:{tmp_path / 'stepped'}")
    assert completion(server, PROMPTS[0])[:2] == (greedy(stepped, PROMPTS[0], MAX_TOKENS), start + 1)

    missing = server.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "absent")})
    assert missing.status_code == 400 and "absent" in missing.json()["error"]["message"]

    sync = WeightSync(server.url, timeout_s=30)
    sync.join()
    params = dict(nudged(model, 2).named_parameters())
    wrong_name = {**params, "model.layers.7.mlp.up_proj.weight": params["model.layers.0.mlp.up_proj.weight"]}
    with pytest.raises(WeightSyncError, match=r"model.layers.7.mlp.up_proj.weight: the model has no"):
        sync.push(wrong_name.items())
    q = "model.layers.1.self_attn.q_proj.weight"
    with pytest.raises(WeightSyncError, match=rf"{q}: shape \[60, 64\], the model's is \[64, 64\]"):
        sync.push({**params, q: params[q][:60]}.items())
    assert version(server)[0] == start + 1
    assert completion(server, PROMPTS[0])[:2] == (greedy(stepped, PROMPTS[0], MAX_TOKENS), start + 1)

    trainer = nudged(model, 2)
    assert sync.push(trainer.named_parameters()) == start + 2  # the group survived the refusals
    assert version(server) == (start + 2, "distributed")
    assert completion(server, PROMPTS[1])[0] == greedy(trainer, PROMPTS[1], MAX_TOKENS)

    killed = subprocess.run(
        [sys.executable, "-c", KILLED_TRAINER, server.url, str(tmp_path / "stepped")],
        timeout=120,
        capture_output=True,
    )
    assert killed.returncode == 3, killed.stderr.decode()[-2000:]
    deadline = time.monotonic() + 30
    while server.metrics().get("kiln:weight_updates_total{outcome=failed}{source=distributed}", 0) < 3:
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.1)
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert version(server) == (start + 2, "distributed")
    assert completion(server, PROMPTS[1])[0] == greedy(trainer, PROMPTS[1], MAX_TOKENS)
    refused = server.post(
        "/update_weights",
        json={"update_info": {"names": [q], "dtype_names": ["float32"], "shapes": [[64, 64]]}},
    )
    assert refused.status_code == 400 and "broke off at tensor" in refused.json()["error"]["message"]

    again = WeightSync(server.url, timeout_s=30)
    again.join()
    assert again.push(stepped.named_parameters()) == start + 3
    assert completion(server, PROMPTS[0])[0] == greedy(stepped, PROMPTS[0], MAX_TOKENS)


# joins, starts an update, sends half of the tensors, dies
KILLED_TRAINER = """
import os, sys, threading, time, httpx, transformers
from kiln.weight_sync import WeightSync
url, folder = sys.argv[1], sys.argv[2]
model = transformers.LlamaForCausalLM.from_pretrained(folder)
sync = WeightSync(url, timeout_s=30)
sync.join()
tensors = [(name, t.detach()) for name, t in model.named_parameters()]
info = {"names": [n for n, _ in tensors], "dtype_names": ["float32"] * len(tensors),
        "shapes": [list(t.shape) for _, t in tensors]}
threading.Thread(target=lambda: httpx.post(url + "/update_weights", json={"update_info": info}, timeout=60),
                 daemon=True).start()
time.sleep(1.0)  # the server has the request and waits for the first tensor
sync._channel.send(t for _, t in tensors[: len(tensors) // 2])
time.sleep(0.5)  # the server has taken them
os._exit(3)
"""


def test_an_update_while_16_streams_decode_gives_each_stream_one_version(
    server: ServerProcess, policy: tuple[Path, Any]
) -> None:
    _, model = policy
    sync = WeightSync(server.url, timeout_s=30)
    sync.join()
    before = nudged(model, 3)
    old = sync.push(before.named_parameters())
    after = nudged(model, 4)
    results: dict[int, tuple[list[int], int]] = {}

    def stream(index: int, num_tokens: int) -> None:
        body = {
            "model": server.model,
            "prompt": PROMPTS[index],
            "max_tokens": num_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "stream": True,
        }
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
            text = ""
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
            results[index] = (rl_loop().token_ids(text), int(response.headers["kiln-weight-version"]))

    first = [threading.Thread(target=stream, args=(i, 160)) for i in range(16)]
    for thread in first:
        thread.start()
    server.wait_for_metrics(lambda samples: samples.get("kiln:num_requests_running", 0) == 16)
    pushed: list[int] = []
    pusher = threading.Thread(target=lambda: pushed.append(sync.push(after.named_parameters())))
    pusher.start()
    # the update reached the engine: received, it pauses the engine (new requests are held) and waits
    deadline = time.monotonic() + 60
    while not httpx.get(f"{server.url}/is_paused", timeout=10).json()["is_paused"]:
        assert time.monotonic() < deadline and pusher.is_alive(), ("no pause for the update", pushed)
        time.sleep(0.02)
    assert not results  # the 16 still decode: the update waits for them
    later = [threading.Thread(target=stream, args=(i, 24)) for i in range(16, 20)]
    for thread in later:
        thread.start()
    for thread in [*first, pusher, *later]:
        thread.join(120)
    assert pushed == [old + 1]
    weights = {old: before, old + 1: after}
    for index, (tokens, served) in sorted(results.items()):
        assert tokens == greedy(weights[served], PROMPTS[index], len(tokens)), (index, served)
    assert [results[i][1] for i in range(20)] == [old] * 16 + [old + 1] * 4
    assert len(results) == 20


def test_pause_resume_sleep_and_wake_up(server: ServerProcess, policy: tuple[Path, Any]) -> None:
    folder, _ = policy
    long: dict[str, Any] = {}

    def run_long() -> None:
        long["answer"] = completion(server, PROMPTS[2], max_tokens=240, ignore_eos=True)

    thread = threading.Thread(target=run_long)
    thread.start()
    server.wait_for_metrics(lambda samples: samples.get("kiln:num_requests_running", 0) > 0)
    assert server.post("/pause", params={"mode": "abort"}).json() == {"success": True, "paused": True}
    thread.join(30)
    assert long["answer"][2] == "abort"
    assert httpx.get(f"{server.url}/is_paused").json() == {"is_paused": True}
    held: dict[str, Any] = {}
    waiting = threading.Thread(target=lambda: held.update(answer=completion(server, PROMPTS[3])))
    waiting.start()
    time.sleep(0.5)
    assert "answer" not in held  # held until resume
    assert server.post("/resume").status_code == 200
    waiting.join(30)
    assert held["answer"][2] in ("length", "stop")
    keep = server.post("/pause", params={"mode": "keep"})
    assert keep.status_code == 400 and "keep is not supported" in keep.json()["error"]["message"]

    assert server.post("/sleep", params={"level": 1}).json() == {"success": True, "sleeping": 1}
    asleep = server.post("/v1/completions", json={"model": server.model, "prompt": [1, 2], "max_tokens": 2})
    assert asleep.status_code == 503 and asleep.json()["error"]["code"] == "engine_asleep"
    assert httpx.get(f"{server.url}/is_sleeping").json() == {"is_sleeping": True, "level": 1}
    served, _ = version(server)
    assert server.post("/wake_up").json()["weight_version"] == served  # level 1 kept the weights
    assert server.post("/sleep", params={"level": 2}).status_code == 200
    assert server.post("/wake_up").json()["weight_version"] == served + 1
    assert version(server) == (served + 1, "artifact")
    original = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    assert completion(server, PROMPTS[4])[0] == greedy(original, PROMPTS[4], MAX_TOKENS)
    samples = server.metrics()
    assert samples["kiln:weight_version"] == served + 1 and samples["kiln:sleep_level"] == 0


def test_the_routes_exist_only_with_the_flag_and_behind_the_api_key(start_app, make_tiny_engine) -> None:
    plain = start_app()
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for stream in (False, True):
        answer = httpx.post(f"{plain.url}/v1/chat/completions", json={**chat, "stream": stream}, timeout=30)
        assert answer.status_code == 200 and answer.headers["kiln-weight-version"] == "0"
    assert httpx.post(f"{plain.url}/update_weights_from_disk", json={"model_path": "x"}).status_code == 404
    assert httpx.post(f"{plain.url}/sleep").status_code == 404

    class NoWeights:
        def from_path(self, path: str) -> Any:
            raise AssertionError("not reached")

    guarded = start_app(api_key="key", weights=NoWeights())
    assert httpx.post(f"{guarded.url}/pause").status_code == 401
    assert httpx.post(f"{guarded.url}/update_weights_from_disk", json={"model_path": "x"}).status_code == 401
    authorized = httpx.post(f"{guarded.url}/pause", headers={"Authorization": "Bearer key"}, timeout=10)
    assert authorized.json() == {"success": True, "paused": True}


def test_a_tensor_parallel_server_updates_every_rank(policy: tuple[Path, Any], tmp_path: Path) -> None:
    folder, model = policy
    server = ServerProcess(
        folder,
        "--backend",
        "reference",
        "--quantization",
        "none",
        "--tensor-parallel-size",
        "2",
        "--enable-weight-updates",
    )
    try:
        stepped = nudged(model, 5)
        stepped.save_pretrained(tmp_path / "stepped")
        answer = server.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "stepped")})
        assert answer.status_code == 200, answer.text
        assert completion(server, PROMPTS[5])[:2] == (greedy(stepped, PROMPTS[5], MAX_TOKENS), 1)
        sync = WeightSync(server.url, timeout_s=30)
        sync.join()
        trainer = nudged(model, 6)
        assert sync.push(trainer.named_parameters()) == 2
        assert completion(server, PROMPTS[6])[0] == greedy(trainer, PROMPTS[6], MAX_TOKENS)
        asleep = server.post("/sleep", params={"level": 1})
        assert asleep.status_code == 409 and "tensor-parallel" in asleep.json()["error"]["message"]
        assert completion(server, PROMPTS[6])[0] == greedy(trainer, PROMPTS[6], MAX_TOKENS)
    finally:
        server.stop()
