"""How a decode step's cost grows with the context: per-layer attention time at several contexts.

    .venv/bin/python bench/context_scaling.py DIR [--contexts 512 2048 6000] [--steps 32] [--prefill 512]

For an artifact folder: fill the KV cache to each context with prefill steps of 512 tokens, then time
`--steps` greedy decode steps (median step time). Attention is the only part of a decode step whose
work grows with the context, so (step at context C − step at context 16) / layers is the attention
time per layer at C, and dividing by C gives the cost per key, which a kernel that reuses its cache
well keeps flat.

With `--prefill N`, the same for a prefill chunk: N tokens ending at context C against the same N
tokens at positions 0..N-1; the difference per layer is the attention over the C - N earlier keys,
per key and query row in the last column.
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
CHUNK = 512
BASE_CONTEXT = 16


def filled_cache(executable, context: int, filled: int, capacity: int):
    """A cache for `capacity` positions holding a random `context`-token prompt's first `filled`
    positions (prefill steps of CHUNK); (cache, block table, prompt, the last step's logits)."""
    blocks = -(-capacity // BLOCK_SIZE)
    table = list(range(1, blocks + 1))
    cache = allocate_kv_cache(executable, blocks + 1, BLOCK_SIZE)
    prompt = torch.randint(100, 30000, (context,), generator=torch.Generator().manual_seed(context)).tolist()
    logits = None
    for first in range(0, filled, CHUNK):
        piece = prompt[first : min(first + CHUNK, filled)]
        logits = executable.step(build_step_inputs([SequenceSlice(piece, first, table)], BLOCK_SIZE), cache)
    return cache, table, prompt, logits


def decode_step_seconds(executable, context: int, steps: int) -> float:
    cache, table, _, logits = filled_cache(executable, context, context, context + steps)
    token, times = int(logits[-1].argmax()), []
    for position in range(context, context + steps):
        started = time.perf_counter()
        inputs = build_step_inputs([SequenceSlice([token], position, table)], BLOCK_SIZE)
        token = int(executable.step(inputs, cache)[-1].argmax())
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def prefill_step_seconds(executable, context: int, rows: int, repeats: int) -> float:
    """One step of the `rows` tokens that end at `context`, the cache filled before them (median)."""
    start = context - rows
    cache, table, prompt, _ = filled_cache(executable, context, start, context)
    times = []
    for _ in range(repeats):  # the same slots rewritten with the same values each time
        started = time.perf_counter()
        executable.step(build_step_inputs([SequenceSlice(prompt[start:], start, table)], BLOCK_SIZE), cache)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 6000])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=0, help="time a prefill chunk of N tokens instead")
    args = parser.parse_args()
    artifact = load_artifact(args.artifact)
    layers = int(artifact.manifest["model"]["config"]["num_hidden_layers"])
    executable = artifact.executable
    print(f"{args.artifact} ({layers} layers); load {os.getloadavg()[0]:.2f}")
    if args.prefill:
        rows, repeats = args.prefill, max(1, min(args.steps, 3))
        base = prefill_step_seconds(executable, rows, rows, repeats)
        print(f"{'context':>8} {'step ms':>8} {'attention ms/layer':>19} {'ns/key/row/layer':>17}")
        print(f"{rows:>8} {base * 1e3:>8.1f} {'(base)':>19} {'':>17}")
        for context in args.contexts:
            step = prefill_step_seconds(executable, context, rows, repeats)
            per_layer = (step - base) / layers
            per_key = per_layer / ((context - rows) * rows) * 1e9 if context > rows else float("nan")
            print(f"{context:>8} {step * 1e3:>8.1f} {per_layer * 1e3:>19.2f} {per_key:>17.3f}")
        print(f"load {os.getloadavg()[0]:.2f} at the end")
        return
    decode_step_seconds(executable, BASE_CONTEXT, 4)  # warm up
    base = decode_step_seconds(executable, BASE_CONTEXT, args.steps)
    print(f"{'context':>8} {'step ms':>8} {'attention us/layer':>19} {'ns/key/layer':>13}")
    print(f"{BASE_CONTEXT:>8} {base * 1e3:>8.2f} {'(base)':>19} {'':>13}")
    for context in args.contexts:
        step = decode_step_seconds(executable, context, args.steps)
        per_layer = (step - base) / layers
        print(f"{context:>8} {step * 1e3:>8.2f} {per_layer * 1e6:>19.1f} {per_layer / context * 1e9:>13.1f}")
    print(f"load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
