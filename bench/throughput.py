"""Engine throughput: N requests with given prompt and output lengths, all submitted at once.

    .venv/bin/python bench/throughput.py [--model NAME] [--concurrency 1 4 16] [--input-len 128]
        [--output-len 128] [--repeats 1]

For each concurrency, runs that many requests through one AsyncEngine (random token prompts, EOS
ignored so each returns exactly --output-len tokens) and prints output tokens/s, time to first token
and inter-token latency (p50, p99), medians over repeats, with the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import resource
import statistics
import time

import torch

from kiln.llm import LLM
from kiln.runtime.async_engine import AsyncEngine
from kiln.runtime.sampling_params import SamplingParams


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def _one(
    engine: AsyncEngine, prompt: list[int], params: SamplingParams, start: float
) -> tuple[float, list[float]]:
    first, stamps = None, []
    async for output in engine.generate(prompt, params):
        now = time.perf_counter()
        for _ in output.outputs[0].delta_token_ids:
            stamps.append(now)
        if first is None and stamps:
            first = now - start
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return first or float("nan"), gaps


async def _round(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    start = time.perf_counter()
    results = await asyncio.gather(*(_one(engine, p, params, start) for p in prompts))
    elapsed = time.perf_counter() - start
    ttfts = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    return {
        "tok_s": len(prompts) * params.max_tokens / elapsed,  # type: ignore[operator]
        "ttft_p50": _percentile(ttfts, 0.5),
        "ttft_p99": _percentile(ttfts, 0.99),
        "itl_p50": _percentile(gaps, 0.5),
        "itl_p99": _percentile(gaps, 0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = parser.parse_args()

    llm = LLM(
        args.model, max_num_seqs=max(args.concurrency), max_num_batched_tokens=args.max_num_batched_tokens
    )
    engine = AsyncEngine(llm.engine)
    vocab = llm.get_tokenizer().vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)
    print(
        f"load {os.getloadavg()[0]:.2f} (1-min avg), torch threads {torch.get_num_threads()}, "
        f"backend reference, {args.input_len} in / {args.output_len} out, median of {args.repeats}"
    )
    print(f"{'concurrency':>12}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}")
    try:
        for concurrency in args.concurrency:
            rounds = []
            for _ in range(args.repeats):
                prompts = [
                    torch.randint(100, vocab, (args.input_len,), generator=generator).tolist()
                    for _ in range(concurrency)
                ]  # fresh prompts: no prefix-cache hits between rounds
                rounds.append(asyncio.run(_round(engine, prompts, params)))
            med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
            print(
                f"{concurrency:>12}{med['tok_s']:>11.1f}{med['ttft_p50']:>9.2f}s{med['ttft_p99']:>9.2f}s"
                f"{med['itl_p50'] * 1000:>7.0f}ms{med['itl_p99'] * 1000:>7.0f}ms"
            )
    finally:
        engine.shutdown()
    print(
        f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB, "
        f"KV cache {llm.engine.num_blocks} blocks of {llm.engine.block_size} tokens"
    )


if __name__ == "__main__":
    main()
