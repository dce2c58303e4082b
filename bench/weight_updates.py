"""Live weight updates on a real model: a running `kiln serve ARTIFACT --enable-weight-updates` takes new
weights from disk (an HF folder of floats, re-quantized to the artifact's GGUF blocks; the GGUF itself,
its blocks as they are) and from a trainer over gloo (kiln.WeightSync), beside what a restart on new
weights costs (compiling them, then starting), and sleep / wake-up (memory handed back, time taken).

    .venv/bin/python bench/weight_updates.py [--model smollm2-135m-instruct] [--repeats 3]

The new weights are the model's own (its GGUF dequantized) moved a little, as a training step would.
Each update is checked by a greedy completion that answers with the new weight version. Medians of
--repeats; RSS from /proc (VmRSS, and its anonymous and file-backed parts).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_peers import KILN, free_port, start, stop  # bench/serve_peers.py

import kiln
from kiln.frontend.load import load_model
from kiln.frontend.pull import kiln_home, resolve_model
from kiln.frontend.source import float32
from kiln.ir.deferred import materialize


def memory_mib(pid: int) -> dict[str, float]:
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                fields[name] = int(value.split()[0]) / 1024
    return fields


def hf_folder(gguf: Path, folder: Path, seed: int) -> dict[str, torch.Tensor]:
    """The GGUF's weights as floats with HF names, moved a little, saved as an HF checkpoint folder."""
    source = load_model(str(gguf))
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, weight in source.weights.items():
        values = materialize(float32(weight))
        weights[name] = (
            values + 0.002 * values.std() * torch.randn(values.shape, generator=generator)
        ).contiguous()
    config = source.config
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"))
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
    }
    (folder / "config.json").write_text(json.dumps(hf))
    return weights


def completion(url: str, max_tokens: int = 16, prompt: str = "The kiln") -> tuple[str, int]:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()["choices"][0]["text"], int(response.headers["kiln-weight-version"])


def timed_post(url: str, path: str, **kwargs: Any) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    response = httpx.post(f"{url}{path}", timeout=600, **kwargs)
    took = time.perf_counter() - started
    response.raise_for_status()
    return took, response.json()


def sixteen_streams(url: str, tokens: int) -> None:
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: completion(url, tokens, f"Stream {i} tells of kilns"), range(16)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--stream-tokens", type=int, default=256, help="tokens each of 16 streams decodes before a sleep"
    )
    args = parser.parse_args()
    work = kiln_home() / "bench-weights" / args.model
    work.mkdir(parents=True, exist_ok=True)
    gguf = resolve_model(args.model)
    artifact = work / "tvm-gguf"
    if not (artifact / "manifest.json").is_file():
        subprocess.run([*KILN, "compile", str(gguf), "--backend", "tvm", "-o", str(artifact)], check=True)
    floats = hf_folder(gguf, work / "stepped", seed=1)
    print(f"load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores", file=sys.stderr)

    results: dict[str, list[float]] = {}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [*KILN, "serve", str(artifact), "--port", str(port), "--served-model-name", "bench"]
    serve += ["--uvicorn-log-level", "warning"]

    plain, _ = start(serve, port, work / "plain.log")
    sixteen_streams(url, args.stream_tokens)
    plain_memory = memory_mib(plain.pid)
    stop(plain)

    for _ in range(args.repeats):
        process, started = start(serve, port, work / "restart.log")
        results.setdefault("restart: start the compiled artifact", []).append(started)
        stop(process)
        fresh = work / "fresh"
        shutil.rmtree(fresh, ignore_errors=True)
        began = time.perf_counter()
        subprocess.run(
            [*KILN, "compile", str(gguf), "--backend", "tvm", "-o", str(fresh), "--quiet"], check=True
        )
        compiled = time.perf_counter() - began
        process, started = start([*serve[:4], str(fresh), *serve[5:]], port, work / "fresh.log")
        results.setdefault("restart on new weights: compile + start", []).append(compiled + started)
        stop(process)

    process, _ = start([*serve, "--enable-weight-updates"], port, work / "updates.log")
    try:
        sixteen_streams(url, args.stream_tokens)
        before_updates = memory_mib(process.pid)
        sync = kiln.WeightSync(url)
        sync.join()
        version = 0
        for _ in range(args.repeats):
            took, answer = timed_post(
                url, "/update_weights_from_disk", json={"model_path": str(work / "stepped")}
            )
            version += 1
            assert answer["weight_version"] == version and completion(url)[1] == version
            results.setdefault("from disk: HF floats, quantized to Q4_1/Q8_0", []).append(took)
            took, answer = timed_post(url, "/update_weights_from_disk", json={"model_path": str(gguf)})
            version += 1
            assert completion(url)[1] == version
            results.setdefault("from disk: the GGUF, blocks as they are", []).append(took)
            began = time.perf_counter()
            version = sync.push(floats.items())
            results.setdefault("over gloo: HF floats, quantized to Q4_1/Q8_0", []).append(
                time.perf_counter() - began
            )
            assert completion(url)[1] == version
        updating_memory = memory_mib(process.pid)

        sleeping: dict[str, list[float]] = {}
        for _ in range(args.repeats):
            for level in (1, 2):
                sixteen_streams(url, args.stream_tokens)
                awake = memory_mib(process.pid)
                took, _ = timed_post(url, "/sleep", params={"level": level})
                asleep = memory_mib(process.pid)
                woke, _ = timed_post(url, "/wake_up")
                after = memory_mib(process.pid)
                completion(url)
                sleeping.setdefault(f"level {level}: RSS awake MiB", []).append(awake["VmRSS"])
                sleeping.setdefault(f"level {level}: RSS asleep MiB", []).append(asleep["VmRSS"])
                sleeping.setdefault(f"level {level}: handed back MiB", []).append(
                    awake["VmRSS"] - asleep["VmRSS"]
                )
                sleeping.setdefault(f"level {level}: anonymous handed back MiB", []).append(
                    awake["RssAnon"] - asleep["RssAnon"]
                )
                sleeping.setdefault(f"level {level}: file-backed handed back MiB", []).append(
                    awake["RssFile"] - asleep["RssFile"]
                )
                sleeping.setdefault(f"level {level}: sleep s", []).append(took)
                sleeping.setdefault(f"level {level}: wake_up s", []).append(woke)
                sleeping.setdefault(f"level {level}: RSS after wake_up MiB", []).append(after["VmRSS"])
        peak = memory_mib(process.pid)["VmHWM"]
    finally:
        stop(process)

    print(f"\n{args.model}, TVM artifact of its GGUF (Q4_1 + Q8_0 blocks), {args.repeats} repeats, medians\n")
    print("| how new weights serve | seconds |")
    print("|---|---|")
    for name, values in results.items():
        print(f"| {name} | {statistics.median(values):.2f} |")
    print("\n| sleep / wake-up | median |")
    print("|---|---|")
    for name, values in sleeping.items():
        print(f"| {name} | {statistics.median(values):.2f} |")
    print(
        f"\nRSS after 16 streams: {plain_memory['VmRSS']:.0f} MiB without --enable-weight-updates "
        f"(peak {plain_memory['VmHWM']:.0f}); with it {before_updates['VmRSS']:.0f} MiB before any update, "
        f"{updating_memory['VmRSS']:.0f} MiB after {3 * args.repeats} updates; peak over the whole run "
        f"{peak:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
