"""Kiln against llama.cpp itself on the GGUF files llama.cpp's converter writes from the tests' tiny models:

    .venv/bin/python bench/llama_cpp_converted.py [FILE.gguf ...] [-n 8] [--llama-server PATH]

FILEs default to the files tests/backends/reference/test_llama_cpp_converted.py cached in
$KILN_HOME/models/converted (run it first). For each: llama-server (`make bench-peers` builds it) greedily
continues a fixed prompt of 40 token ids by n tokens and reports its top-5 log-probabilities before
sampling at each of them; Kiln's reference backend, loading the same file, runs the same tokens. The
table: whether the greedy tokens are the same, and the largest |difference| of the log-probabilities of
llama.cpp's top 5 at every position. The tests check Kiln against transformers on the HF model; this
checks that llama.cpp reads the file the same way Kiln does.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kiln.backends.reference import ReferenceExecutable
from kiln.frontend.capture import capture_weights
from kiln.frontend.load import load_model
from kiln.frontend.pull import kiln_home
from kiln.ir.step import SequenceSlice, build_step_inputs

REPO = Path(__file__).resolve().parents[1]
PROMPT = [int(t) for t in np.random.default_rng(40).integers(1, 256, 40)]
TOP = 5
BLOCK_SIZE = 16


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def llama_cpp_continuation(
    server: Path, gguf: Path, n: int
) -> tuple[list[int], list[dict[int, float] | None]]:
    """llama-server's greedy tokens after PROMPT and, at each it reports, its top-5 log-probabilities."""
    port = _free_port()
    command = [str(server), "-m", str(gguf), "--port", str(port), "-t", "1", "-c", "256", "--no-warmup"]
    command += ["--cache-type-k", "f32", "--cache-type-v", "f32", "--flash-attn", "off"]  # all float32
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # (its log names why it refuses a file: run the command by hand)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server does not load it (exit {process.poll()})")
            time.sleep(0.2)
        body = {"prompt": PROMPT, "n_predict": n, "temperature": 0, "n_probs": TOP, "ignore_eos": True}
        body |= {"post_sampling_probs": False, "return_tokens": True}
        answer = httpx.post(f"{url}/completion", json=body, timeout=120).json()
        if answer["tokens_evaluated"] != len(PROMPT):
            raise SystemExit(
                f"llama-server evaluated {answer['tokens_evaluated']} prompt tokens, not {len(PROMPT)}"
            )
        tokens = answer["tokens"]
        # llama-server leaves out the probabilities of tokens it holds back as partial UTF-8: align by id
        tops: list[dict[int, float] | None] = [None] * len(tokens)
        position = 0
        for step in answer["completion_probabilities"]:
            position = tokens.index(step["id"], position)
            tops[position] = {p["id"]: p["logprob"] for p in step["top_logprobs"]}
            position += 1
        return tokens, tops
    finally:
        process.terminate()
        process.wait(30)


def kiln_log_probabilities(gguf: Path, tokens: list[int]) -> list[np.ndarray]:
    """Kiln's reference backend on the file: log-probabilities after PROMPT and after each of `tokens`."""
    source = load_model(str(gguf))
    captured = capture_weights(source.config, source.float_weights())
    executable = ReferenceExecutable(captured.graph, captured.weights)
    total = len(PROMPT) + len(tokens)
    table = list(range(-(-total // BLOCK_SIZE)))
    cache = executable.kv_cache_spec.allocate(len(table), BLOCK_SIZE)
    out: list[np.ndarray] = []
    fed = list(PROMPT)
    position = 0
    for token in [None, *tokens[:-1]]:
        chunk = fed[position:] if token is None else [token]
        logits = executable.step(
            build_step_inputs([SequenceSlice(chunk, position, table)], BLOCK_SIZE), cache
        )
        position += len(chunk)
        row = np.asarray(logits[0], np.float64)
        out.append(row - row.max() - np.log(np.exp(row - row.max()).sum()))
    return out


def compare(server: Path, gguf: Path, n: int) -> dict[str, Any]:
    tokens, tops = llama_cpp_continuation(server, gguf, n)
    ours = kiln_log_probabilities(gguf, tokens)
    greedy = [int(np.argmax(row)) for row in ours]
    compared = [(row, top) for row, top in zip(ours, tops, strict=True) if top is not None]
    error = max(abs(float(row[i]) - logprob) for row, top in compared for i, logprob in top.items())
    return {"file": gguf.name, "same_greedy": greedy == tokens, "positions": len(compared), "error": error}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("-n", type=int, default=8, help="tokens to continue by")
    parser.add_argument("--llama-server", type=Path, default=REPO / ".venv-peers/llama.cpp/bin/llama-server")
    args = parser.parse_args()
    files = args.files or sorted((kiln_home() / "models" / "converted").glob("*.gguf"))
    if not files:
        raise SystemExit(
            "no files: run tests/backends/reference/test_llama_cpp_converted.py first, or name them"
        )
    print(f"| file | greedy tokens the same ({args.n}) | positions reported | max abs logprob difference |")
    print("|---|---|---|---|")
    for gguf in files:
        try:
            row = compare(args.llama_server, gguf, args.n)
        except RuntimeError as error:
            print(f"| {gguf.name} | {error} | | |", flush=True)
            continue
        same = "yes" if row["same_greedy"] else "NO"
        print(f"| {row['file']} | {same} | {row['positions']} | {row['error']:.2e} |", flush=True)


if __name__ == "__main__":
    main()
