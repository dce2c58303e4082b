"""llama-bench's pp/tg measurement for kiln artifact folders, so the two read side by side.

    .venv/bin/python bench/artifact_bench.py DIR [DIR ...] [-p 512] [-n 128] [-r 3]
    .venv/bin/python bench/artifact_bench.py DIR --parallel 16 -p 128 -n 128     (llama-batched-bench's
        -npl 16 -npp 128 -ntg 128: 16 sequences' prompts in one step, then 128 steps of 16 rows)

For each artifact (any backend and target that runs here, e.g. `kiln compile MODEL --target
cpu:znver3` for the AVX2 variant on an AVX-512 host): pp = one step over a P-token prompt, tg = N greedy
decode steps from an empty context (as llama-bench's tg), medians of R runs, each on a fresh KV cache.
Threads: the artifact's (TVM_NUM_THREADS, default every CPU this process may use).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from kiln.backends.base import allocate_kv_cache
from kiln.ir.step import SequenceSlice, build_step_inputs
from kiln.runtime.artifact import load_artifact

BLOCK_SIZE = 16


def measure(folder: Path, prompt_len: int, decode_len: int, repeats: int) -> tuple[float, float]:
    executable = load_artifact(folder).executable
    prompt = torch.randint(100, 30000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    blocks = -(-max(prompt_len, decode_len) // BLOCK_SIZE)
    table = list(range(1, blocks + 1))
    prefill, decode = [], []
    for _ in range(repeats + 1):  # the first run warms up (thread pool, first-call allocations)
        cache = allocate_kv_cache(executable, blocks + 1, BLOCK_SIZE)
        start = time.perf_counter()
        executable.step(build_step_inputs([SequenceSlice(prompt, 0, table)], BLOCK_SIZE), cache)
        prefill.append(prompt_len / (time.perf_counter() - start))
        cache = allocate_kv_cache(executable, blocks + 1, BLOCK_SIZE)
        token, start = 1, time.perf_counter()
        for position in range(decode_len):
            inputs = build_step_inputs([SequenceSlice([token], position, table)], BLOCK_SIZE)
            token = int(executable.step(inputs, cache)[-1].argmax())
        decode.append(decode_len / (time.perf_counter() - start))
    return statistics.median(prefill[1:]), statistics.median(decode[1:])


def measure_parallel(
    folder: Path, sequences: int, prompt_len: int, decode_len: int, repeats: int
) -> tuple[float, float, float]:
    """(prompt tok/s, decode tok/s, all tokens / all time) for `sequences` at once, medians."""
    executable = load_artifact(folder).executable
    per_sequence = -(-(prompt_len + decode_len) // BLOCK_SIZE)
    tables = [list(range(1 + i * per_sequence, 1 + (i + 1) * per_sequence)) for i in range(sequences)]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 30000, (prompt_len,), generator=generator).tolist() for _ in tables]
    prefill, decode, overall = [], [], []
    for _ in range(repeats + 1):
        cache = allocate_kv_cache(executable, sequences * per_sequence + 1, BLOCK_SIZE)
        start = time.perf_counter()
        slices = [SequenceSlice(prompt, 0, table) for prompt, table in zip(prompts, tables, strict=True)]
        logits = executable.step(build_step_inputs(slices, BLOCK_SIZE), cache)
        prompt_seconds = time.perf_counter() - start
        tokens = logits.argmax(-1).tolist()
        start = time.perf_counter()
        for position in range(prompt_len, prompt_len + decode_len):
            slices = [SequenceSlice([t], position, table) for t, table in zip(tokens, tables, strict=True)]
            tokens = executable.step(build_step_inputs(slices, BLOCK_SIZE), cache).argmax(-1).tolist()
        decode_seconds = time.perf_counter() - start
        prefill.append(sequences * prompt_len / prompt_seconds)
        decode.append(sequences * decode_len / decode_seconds)
        overall.append(sequences * (prompt_len + decode_len) / (prompt_seconds + decode_seconds))
    return statistics.median(prefill[1:]), statistics.median(decode[1:]), statistics.median(overall[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("-p", "--prompt-len", type=int, default=512)
    parser.add_argument("-n", "--decode-len", type=int, default=128)
    parser.add_argument("-r", "--repeats", type=int, default=3)
    parser.add_argument(
        "--parallel", type=int, default=0, help="sequences at once (llama-batched-bench -npl)"
    )
    args = parser.parse_args()
    if args.parallel:
        print(
            f"load {os.getloadavg()[0]:.2f}; {args.parallel} sequences,"
            f" pp{args.prompt_len} tg{args.decode_len}"
        )
        for folder in args.artifacts:
            pp, tg, overall = measure_parallel(
                folder, args.parallel, args.prompt_len, args.decode_len, args.repeats
            )
            print(f"{folder}: S_PP {pp:.1f}  S_TG {tg:.1f}  S {overall:.1f} tok/s", flush=True)
        print(f"load {os.getloadavg()[0]:.2f} at the end")
        return
    lengths = f"pp{args.prompt_len} and tg{args.decode_len}"
    print(f"load {os.getloadavg()[0]:.2f}; {lengths} tok/s, median of {args.repeats}")
    for folder in args.artifacts:
        pp, tg = measure(folder, args.prompt_len, args.decode_len, args.repeats)
        print(f"{folder}: pp{args.prompt_len} {pp:.1f}  tg{args.decode_len} {tg:.1f}", flush=True)
    print(f"load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
