"""Kiln's servers and llama-server on the same GGUF, one after another in one run, under the same load
(bench/serve.py: streamed completions, unique prompt prefixes, exactly --output-len tokens each), with
each server's cold start (launch to a 200 from /health) and peak RSS.

    .venv/bin/python bench/serve_peers.py [--model smollm2-135m-instruct] [--concurrency 1 4 16]
        [--skip reference llama-server] [--threads 2]

Rows:
  kiln serve MODEL       what `make serve` runs: the default (--backend auto, --quantization auto), from
                         the compile cache (compiled first if needed, outside the timing)
  kiln serve DIR         the same model compiled by `kiln compile --backend tvm --quantization gguf`
  reference f32          `kiln serve MODEL --backend reference --quantization none` (the old default;
                         slow, so it runs 1 request at 1 stream and 16 at 16 streams, no 4-stream level)
  llama-server           llama.cpp's server (`make bench-peers` builds it) with -np 16 -t THREADS -c 8192

After the servers, the same run times the DIR artifact's own decode step (bench/artifact_bench.py, no
server): tg128 from an empty context, as llama-bench's, and the step after an --input-len prompt, the
context a served stream decodes at; each Kiln row's 1-stream ITL p50 is set against both.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import artifact_bench  # bench/artifact_bench.py
import serve as load  # bench/serve.py

ROOT = Path(__file__).resolve().parent.parent
KILN = [sys.executable, "-m", "kiln.cli"]
LLAMA_SERVER = ROOT / ".venv-peers/llama.cpp/bin/llama-server"
SERVED_NAME = "bench"


@dataclass
class Server:
    name: str
    command: list[str]
    concurrency: list[int]
    requests_per_stream: int = 2  # requests per level: this × the concurrency (at least 4 where it is 2)

    def num_requests(self, concurrency: int) -> int:
        count = self.requests_per_stream * concurrency
        return max(4, count) if self.requests_per_stream >= 2 else count


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(command: list[str], port: int, log: Path) -> tuple[subprocess.Popen[bytes], float]:
    """Launch and wait for /health; (process, seconds from launch to the first 200)."""
    launched = time.perf_counter()
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    while time.perf_counter() - launched < 900:
        if process.poll() is not None:
            raise RuntimeError(f"{command[0]} exited with {process.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process, time.perf_counter() - launched
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    process.kill()
    raise RuntimeError(f"{command[0]} was not healthy after 900 s; see {log}")


def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def prepare(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """(the model's GGUF, the TVM gguf artifact), compiling the artifact and warming the cache."""
    from kiln.frontend.pull import resolve_model

    gguf = resolve_model(args.model)
    artifact = work / args.model / "tvm-gguf"
    if not (artifact / "manifest.json").is_file():
        subprocess.run(
            [*KILN, "compile", args.model, "--backend", "tvm", "--quantization", "gguf", "-o", str(artifact)],
            check=True,
        )
    # the default path compiles into the cache on its first start: do that before anything is timed
    subprocess.run([*KILN, "generate", args.model, "--prompt", "Hi", "--max-tokens", "1"], check=True)
    return gguf, artifact


def llama_server_command(gguf: Path, threads: int, context: int, port: int) -> list[str]:
    """llama-server on `gguf` with 16 slots sharing `context` tokens, serving as SERVED_NAME."""
    slots = ["-np", "16", "-t", str(threads), "-c", str(context)]
    return [str(LLAMA_SERVER), "-m", str(gguf), *slots, "--port", str(port), "--alias", SERVED_NAME]


def servers(args: argparse.Namespace, gguf: Path, artifact: Path, port: int) -> list[Server]:
    common = ["--port", str(port), "--served-model-name", SERVED_NAME, "--uvicorn-log-level", "warning"]
    levels = args.concurrency
    rows = [
        Server("kiln serve MODEL (make serve)", [*KILN, "serve", args.model, *common], levels),
        Server("kiln serve DIR (tvm gguf)", [*KILN, "serve", str(artifact), *common], levels),
        Server(
            "kiln reference f32 (old default)",
            [*KILN, "serve", args.model, "--backend", "reference", "--quantization", "none", *common],
            [c for c in levels if c in (1, 16)],
            requests_per_stream=1,
        ),
        Server(
            f"llama-server -np 16 -t {args.threads}",
            llama_server_command(gguf, args.threads, 8192, port),
            levels,
        ),
    ]
    skip = set(args.skip)
    return [s for s in rows if not any(word in s.name for word in skip)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--eos-token-id", type=int, default=2, help="banned with logit_bias (SmolLM2: 2)")
    parser.add_argument("--skip", nargs="*", default=[], help="rows whose name holds one of these words")
    args = parser.parse_args()
    from kiln.frontend.pull import kiln_home

    work = kiln_home() / "bench-serve"
    work.mkdir(parents=True, exist_ok=True)
    gguf, artifact = prepare(args, work)
    results: list[tuple[Server, float, list[dict[str, float]]]] = []
    for server in servers(args, gguf, artifact, port := free_port()):
        if server.command[0] == str(LLAMA_SERVER) and not LLAMA_SERVER.is_file():
            print(f"{server.name}: skipped, {LLAMA_SERVER} is missing (make bench-peers builds it)")
            continue
        print(f"\n== {server.name}: {' '.join(server.command)}", flush=True)
        process, cold = start(server.command, port, work / f"server-{len(results)}.log")
        print(f"healthy after {cold:.2f} s")
        rows: list[dict[str, float]] = []
        try:
            for level in server.concurrency:
                load_args = load.parser().parse_args(
                    ["--base-url", f"http://127.0.0.1:{port}", "--model", SERVED_NAME]
                    + ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
                    + ["--eos-token-id", str(args.eos_token_id), "--pid", str(process.pid)]
                    + ["--concurrency", str(level), "--num-requests", str(server.num_requests(level))]
                    + (["--no-warmup"] if rows else [])
                )
                rows += asyncio.run(load.run_levels(load_args))
        finally:
            stop(process)
        results.append((server, cold, rows))
    levels = args.concurrency
    print(f"\nsummary: output tok/s per concurrency, cold start, peak RSS; load {os.getloadavg()[0]:.2f}")
    print(f"{'server':<34}" + "".join(f"{f'{c} str':>9}" for c in levels) + f"{'cold s':>8}{'peak MiB':>10}")
    for server, cold, rows in results:
        by_level = {int(r["concurrency"]): r["tok_s"] for r in rows}
        cells = "".join(f"{by_level[c]:>9.1f}" if c in by_level else f"{'—':>9}" for c in levels)
        peak = max(r["peak_rss_mib"] for r in rows)
        print(f"{server.name:<34}{cells}{cold:>8.2f}{peak:>10.0f}")
    if 1 in levels:
        one_stream_against_the_step(args, artifact, results)


def one_stream_against_the_step(
    args: argparse.Namespace, artifact: Path, results: list[tuple[Server, float, list[dict[str, float]]]]
) -> None:
    """Each Kiln row's 1-stream ITL p50 over the artifact's own decode step, timed now (no server up)."""
    _, tg = artifact_bench.measure(artifact, args.input_len, args.output_len, repeats=3)
    _, after_prompt, _ = artifact_bench.measure_parallel(
        artifact, 1, args.input_len, args.output_len, repeats=3
    )
    empty_ms, served_ms = 1e3 / tg, 1e3 / after_prompt
    print(
        f"\nartifact decode step ({artifact.name}, no server): tg{args.output_len} {empty_ms:.2f} ms, "
        f"after a {args.input_len}-token prompt {served_ms:.2f} ms; load {os.getloadavg()[0]:.2f}"
    )
    for server, _, rows in results:
        one = [r for r in rows if int(r["concurrency"]) == 1]
        if not one or not server.name.startswith("kiln"):
            continue
        itl_ms = one[0]["itl_p50"] * 1e3
        print(
            f"{server.name:<34} 1-stream ITL p50 {itl_ms:.2f} ms = {itl_ms / empty_ms:.2f}x tg"
            f"{args.output_len}, {itl_ms / served_ms:.2f}x the step after the prompt"
        )


if __name__ == "__main__":
    main()
