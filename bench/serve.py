"""Load any OpenAI-compatible server with concurrent streamed completions; print throughput and latency.

    .venv/bin/python bench/serve.py --base-url http://127.0.0.1:8000 --model NAME [--concurrency 1 4 16]
        [--input-len 128] [--output-len 128] [--num-requests N] [--api-key KEY] [--eos-token-id ID]
        [--pid PID]

For each concurrency C, sends N requests (default 2 × C, at least 4) to /v1/completions, C at a time,
each streamed, and prints output tokens/s (all requests' tokens over the wall time), time to first
token and inter-token latency (p50, p99). Every request has its own prompt prefix, so no request reuses
another's cached prefix; the prompt is cut to --input-len tokens with the server's /tokenize and
/detokenize when it has them (vLLM, kiln), else sized by words. Each request asks for exactly
--output-len tokens: `ignore_eos` (vLLM, kiln), plus `logit_bias {eos: -100}` with --eos-token-id for
servers without it; a request that returns another count is reported. With --pid (a server on this
machine), each row also shows the server process's peak resident memory so far (VmHWM).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import time
import uuid
from dataclasses import dataclass, field

import httpx

FILLER = (
    "the quick brown fox jumps over the lazy dog while a kiln fires clay pots and the potter waits for "
    "the glaze to cool so that every bowl and cup can be sold at the market on the next day "
).split()


@dataclass
class Result:
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    error: str | None = None
    started: float = 0.0  # perf_counter when the request was sent
    arrivals: list[float] = field(default_factory=list)  # perf_counter of each chunk with text


def peak_rss_mib(pid: int | None) -> float:
    """The peak resident set (VmHWM) of process `pid` so far, in MiB; nan without one."""
    if pid is None:
        return float("nan")
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def make_prompt(client: httpx.AsyncClient, model: str, index: int, input_len: int) -> str:
    """A prompt of about `input_len` tokens that starts with a prefix no other request has."""
    prefix = f"Request {index} ({uuid.uuid4().hex[:8]}): "
    words = prefix + " ".join(itertools.islice(itertools.cycle(FILLER), 2 * input_len))
    try:
        tokens = await client.post("/tokenize", json={"model": model, "prompt": words})
        if tokens.status_code == 200:
            ids = tokens.json()["tokens"][:input_len]
            text = await client.post("/detokenize", json={"model": model, "tokens": ids})
            if text.status_code == 200:
                return text.json()["prompt"]
    except (httpx.HTTPError, KeyError, ValueError):
        pass
    return prefix + " ".join(itertools.islice(itertools.cycle(FILLER), max(1, input_len - 6)))


async def one_request(
    client: httpx.AsyncClient, body: dict[str, object], result: Result | None = None
) -> Result:
    """Stream one completion into `result` (a new one if None), which fills in as chunks arrive."""
    result = result if result is not None else Result()
    start = result.started = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    break
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.completion_tokens = usage.get("completion_tokens", result.completion_tokens)
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                result.arrivals.append(now)
                if last is None:
                    result.ttft = now - start
                else:
                    result.gaps.append(now - last)
                last = now
                if not usage:
                    result.completion_tokens += 1  # replaced by usage when the server sends it
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
    return result


async def run_level(
    client: httpx.AsyncClient, args: argparse.Namespace, concurrency: int, num_requests: int
) -> dict[str, float]:
    prompts = [await make_prompt(client, args.model, i, args.input_len) for i in range(num_requests)]
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt: str) -> Result:
        body: dict[str, object] = {
            "model": args.model,
            "prompt": prompt,
            "max_tokens": args.output_len,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        if args.eos_token_id is not None:
            body["logit_bias"] = {str(args.eos_token_id): -100}
        async with gate:
            return await one_request(client, body)

    start = time.perf_counter()
    results = await asyncio.gather(*(gated(p) for p in prompts))
    elapsed = time.perf_counter() - start
    failed = [r for r in results if r.error]
    for r in failed[:3]:
        print(f"  request failed: {r.error}")
    done = [r for r in results if not r.error]
    short = [r for r in done if r.completion_tokens != args.output_len]
    if short:
        print(f"  {len(short)} requests returned other than {args.output_len} tokens")
    ttfts = [r.ttft for r in done if r.ttft is not None]
    gaps = [g for r in done for g in r.gaps]
    prompt_lens = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    return {
        "requests": len(results),
        "failed": len(failed),
        "prompt_tokens": statistics.mean(prompt_lens) if prompt_lens else float("nan"),
        "tok_s": sum(r.completion_tokens for r in done) / elapsed,
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p99": percentile(ttfts, 0.99),
        "itl_p50": percentile(gaps, 0.5),
        "itl_p99": percentile(gaps, 0.99),
        "elapsed": elapsed,
    }


async def run_levels(args: argparse.Namespace) -> list[dict[str, float]]:
    """One row per concurrency level (printed as it is measured), each with the server's peak RSS."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency) + 2)
    rows = []
    async with httpx.AsyncClient(
        base_url=args.base_url.rstrip("/"), headers=headers, timeout=None, limits=limits
    ) as client:
        print(
            f"{args.base_url} model {args.model}: input {args.input_len} tokens, output {args.output_len} "
            f"tokens; load {os.getloadavg()[0]:.2f} (1-min avg)"
        )
        if not args.no_warmup:
            await one_request(
                client, {"model": args.model, "prompt": "Warm up.", "max_tokens": 2, "stream": True}
            )
        print(
            f"{'conc':>4} {'reqs':>5} {'prompt':>6} {'out tok/s':>10} {'ttft p50':>9} {'ttft p99':>9} "
            f"{'itl p50':>8} {'itl p99':>8} {'wall':>7} {'peak MiB':>9}   (latencies in ms, wall in s)"
        )
        for concurrency in args.concurrency:
            num_requests = args.num_requests or max(4, 2 * concurrency)
            row = await run_level(client, args, concurrency, num_requests)
            row["concurrency"] = concurrency
            row["peak_rss_mib"] = peak_rss_mib(args.pid)
            rows.append(row)
            print(
                f"{concurrency:>4} {row['requests']:>5} {row['prompt_tokens']:>6.0f} {row['tok_s']:>10.1f} "
                f"{row['ttft_p50'] * 1e3:>9.0f} {row['ttft_p99'] * 1e3:>9.0f} {row['itl_p50'] * 1e3:>8.1f} "
                f"{row['itl_p99'] * 1e3:>8.1f} {row['elapsed']:>7.1f} {row['peak_rss_mib']:>9.0f}"
                + (f"  {row['failed']} failed" if row["failed"] else ""),
                flush=True,
            )
        print(f"load {os.getloadavg()[0]:.2f} (1-min avg) at the end")
    return rows


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--model", required=True, help="the model name the server serves")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--num-requests", type=int, default=None, help="per level (default 2 × C, >= 4)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--eos-token-id", type=int, default=None, help="also send logit_bias {ID: -100}")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--pid", type=int, default=None, help="the server's process id: report its peak RSS")
    return parser


def main() -> None:
    asyncio.run(run_levels(parser().parse_args()))


if __name__ == "__main__":
    main()
