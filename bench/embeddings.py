"""Embeddings served: `kiln serve` against `llama-server --embeddings` on the same GGUF, one after the
other in one run, the same texts and the same pooling (last token, normalized), with each server's
peak RSS, and how close the two servers' vectors are.

    .venv/bin/python bench/embeddings.py [--model smollm2-135m-instruct] [--texts 64] [--words 96]
        [--concurrency 1 16] [--batch 16] [--threads 2] [--repeats 3]

Loads: `--concurrency C`: C clients each sending one text a request until --texts are embedded
(inputs/s, and the median request latency); `--batch B`: one client sending B texts a request (the
ingestion of a document store). Each load runs --repeats times; the table shows medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_offload import rss_peak_mib  # bench/kv_offload.py
from serve_peers import KILN, LLAMA_SERVER, free_port, prepare, start, stop  # bench/serve_peers.py

WORDS = (
    "kiln clay glaze fire temperature vessel potter wheel cone oxide ash salt soda reduction "
    "stoneware porcelain earthenware bisque slip wedge trim foot rim handle lid spout crawl craze"
).split()


def texts(count: int, words: int, seed: int = 0) -> list[str]:
    chooser = random.Random(seed)
    return [" ".join(chooser.choice(WORDS) for _ in range(words)) + f" ({i})" for i in range(count)]


async def embed_one_each(
    port: int, inputs: list[str], concurrency: int
) -> tuple[float, float, list[list[float]]]:
    """(seconds for all, median request seconds, vectors in input order) with `concurrency` clients."""
    vectors: list[list[float]] = [[] for _ in inputs]
    latencies: list[float] = []
    queue = list(range(len(inputs)))

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            index = queue.pop(0)
            began = time.perf_counter()
            reply = await http.post("/v1/embeddings", json={"model": "bench", "input": inputs[index]})
            reply.raise_for_status()
            latencies.append(time.perf_counter() - began)
            vectors[index] = reply.json()["data"][0]["embedding"]

    began = time.perf_counter()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return time.perf_counter() - began, statistics.median(latencies), vectors


async def embed_batches(port: int, inputs: list[str], batch: int) -> tuple[float, int]:
    """(seconds for all, prompt tokens the server counted) sending `batch` texts a request."""
    began, tokens = time.perf_counter(), 0
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:
        for first in range(0, len(inputs), batch):
            body = {"model": "bench", "input": inputs[first : first + batch]}
            reply = await http.post("/v1/embeddings", json=body)
            reply.raise_for_status()
            tokens += reply.json()["usage"]["prompt_tokens"]
    return time.perf_counter() - began, tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--words", type=int, default=96)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--llama-batch", nargs=2, default=["512", "2048"], metavar=("UBATCH", "BATCH"), help="its -ub and -b"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-embeddings-"))
    gguf, _ = prepare(args, work)
    inputs = texts(args.texts, args.words)
    port = free_port()
    common = ["--port", str(port), "--served-model-name", "bench", "--uvicorn-log-level", "warning"]
    servers = {
        "kiln serve MODEL --pooling last": [*KILN, "serve", args.model, "--pooling", "last", *common],
        f"llama-server --embeddings --pooling last -t {args.threads}": [
            str(LLAMA_SERVER),
            "-m",
            str(gguf),
            "--embeddings",
            "--pooling",
            "last",
            "-np",
            "16",
            "-t",
            str(args.threads),
            "-c",
            "8192",
            "-ub",
            "2048",
            "-b",
            "2048",
            "--port",
            str(port),
            "--alias",
            "bench",
        ],
    }
    print(f"{args.texts} texts of {args.words} words; load {os.getloadavg()[0]:.2f} at the start")
    rows: dict[str, dict[str, float]] = {}
    vectors: dict[str, np.ndarray] = {}
    for name, command in servers.items():
        process, started = start(command, port, work / f"{len(rows)}.log")
        try:
            row: dict[str, float] = {"start s": started}
            for concurrency in args.concurrency:
                runs = [asyncio.run(embed_one_each(port, inputs, concurrency)) for _ in range(args.repeats)]
                row[f"inputs/s c={concurrency}"] = args.texts / statistics.median(r[0] for r in runs)
                row[f"p50 request s c={concurrency}"] = statistics.median(r[1] for r in runs)
                vectors[name] = np.array(runs[0][2])
            batches = [asyncio.run(embed_batches(port, inputs, args.batch)) for _ in range(args.repeats)]
            row[f"inputs/s batch={args.batch}"] = args.texts / statistics.median(b[0] for b in batches)
            row["tokens/text"] = batches[0][1] / args.texts
            row["peak RSS MiB"] = rss_peak_mib(process.pid)
            rows[name] = row
        finally:
            stop(process)
        print(f"{name}: done; load {os.getloadavg()[0]:.2f}", flush=True)
    names = list(rows)
    columns = list(rows[names[0]])
    print("\n| server | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name in names:
        print(f"| {name} | " + " | ".join(f"{rows[name][c]:.3f}" for c in columns) + " |")
    if len(names) == 2:
        first, second = vectors[names[0]], vectors[names[1]]
        cosines = np.sum(first * second, axis=1) / (
            np.linalg.norm(first, axis=1) * np.linalg.norm(second, axis=1)
        )
        median = float(np.median(cosines))
        print(f"\ncosine of kiln's and llama-server's vectors: min {cosines.min():.6f}, median {median:.6f}")
        ratio = {c: rows[names[0]][c] / rows[names[1]][c] for c in columns if c.startswith("inputs/s")}
        print("kiln / llama-server inputs/s: " + ", ".join(f"{c}: {r:.2f}x" for c, r in ratio.items()))
    print(f"load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
