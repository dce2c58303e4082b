"""Long prompts arriving while streams decode: do the decoding streams stall?

    .venv/bin/python bench/mixed_load.py [--model smollm2-135m-instruct] [--decoders 12] [--long 4]
        [--long-len 2000] [--skip llama-server] [--kiln-args "--max-step-ms 40"]

Per server (`kiln serve MODEL`, as `make serve` runs it, then llama-server -np 16 on the same GGUF):
--decoders streamed completions (128-token prompts, greedy, EOS ignored) start; once every one of them
has its first token, --long requests with --long-len-token prompts arrive at once (16 tokens out each).
Printed: the decoding streams' inter-token gaps (p50 and p99, and their ratio) over the time the long
prompts were being computed (from their arrival to the last one's first token) and over the whole
run; the long prompts' time to first token; output tokens/s; the server's peak RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve as load  # bench/serve.py
import serve_peers as peers  # bench/serve_peers.py

DECODER_PROMPT_LEN = 128
LONG_OUTPUT_LEN = 16


def body(model: str, prompt: str, max_tokens: int, eos_token_id: int | None) -> dict[str, object]:
    request: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    if eos_token_id is not None:
        request["logit_bias"] = {str(eos_token_id): -100}
    return request


def gaps_within(streams: list[load.Result], start: float, end: float) -> list[float]:
    """Gaps between consecutive tokens of each stream whose later token arrived in [start, end]."""
    return [
        later - earlier
        for stream in streams
        for earlier, later in zip(stream.arrivals, stream.arrivals[1:], strict=False)
        if start <= later <= end
    ]


async def run(base_url: str, args: argparse.Namespace, pid: int) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        model = peers.SERVED_NAME
        short = [await load.make_prompt(client, model, i, DECODER_PROMPT_LEN) for i in range(args.decoders)]
        long = [await load.make_prompt(client, model, 100 + i, args.long_len) for i in range(args.long)]
        await load.one_request(client, body(model, "Hello", 4, args.eos_token_id))  # warm-up
        decoders = [load.Result() for _ in short]
        begun = time.perf_counter()
        decoding = [
            asyncio.create_task(
                load.one_request(client, body(model, p, args.decode_len, args.eos_token_id), s)
            )
            for p, s in zip(short, decoders, strict=True)
        ]
        while not all(s.arrivals or s.error for s in decoders):
            await asyncio.sleep(0.01)
        await asyncio.sleep(args.settle_s)
        longs = [load.Result() for _ in long]
        arrived = time.perf_counter()
        await asyncio.gather(
            *(
                load.one_request(client, body(model, p, LONG_OUTPUT_LEN, args.eos_token_id), s)
                for p, s in zip(long, longs, strict=True)
            )
        )
        prefilled = max((s.arrivals[0] for s in longs if s.arrivals), default=arrived)
        await asyncio.gather(*decoding)
        ended = time.perf_counter()
    failed = [s.error for s in decoders + longs if s.error]
    for error in failed[:3]:
        print(f"  request failed: {error}")
    during = gaps_within(decoders, arrived, prefilled)
    overall = gaps_within(decoders, begun, ended)
    ttfts = [s.arrivals[0] - s.started for s in longs if s.arrivals]
    tokens = sum(len(s.arrivals) for s in decoders + longs)
    return {
        "failed": len(failed),
        "during_p50": load.percentile(during, 0.5),
        "during_p99": load.percentile(during, 0.99),
        "all_p50": load.percentile(overall, 0.5),
        "all_p99": load.percentile(overall, 0.99),
        "long_ttft_p50": load.percentile(ttfts, 0.5),
        "long_ttft_max": max(ttfts) if ttfts else float("nan"),
        "window_s": prefilled - arrived,
        "tok_s": tokens / (ended - begun),
        "peak_rss_mib": load.peak_rss_mib(pid),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--decoders", type=int, default=12)
    parser.add_argument("--decode-len", type=int, default=256, help="tokens each decoding stream asks for")
    parser.add_argument("--long", type=int, default=4)
    parser.add_argument("--long-len", type=int, default=2000)
    parser.add_argument("--settle-s", type=float, default=0.5, help="decoding before the long prompts come")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--eos-token-id", type=int, default=2, help="banned with logit_bias (SmolLM2: 2)")
    parser.add_argument("--kiln-args", default="", help="more `kiln serve` flags, as one string")
    parser.add_argument("--skip", nargs="*", default=[], help="rows whose name holds one of these words")
    args = parser.parse_args()
    from kiln.frontend.pull import kiln_home, resolve_model

    gguf = resolve_model(args.model)
    work = kiln_home() / "bench-mixed"
    work.mkdir(parents=True, exist_ok=True)
    port = peers.free_port()
    common = ["--port", str(port), "--served-model-name", peers.SERVED_NAME, "--uvicorn-log-level", "warning"]
    context = (args.long_len + 512) * 16
    kiln = [*peers.KILN, "serve", args.model, *common, *shlex.split(args.kiln_args)]
    rows = [
        (f"kiln serve MODEL {args.kiln_args}".strip(), kiln),
        (
            f"llama-server -np 16 -t {args.threads} -c {context}",
            peers.llama_server_command(gguf, args.threads, context, port),
        ),
    ]
    # the compile cache warm before anything is timed
    subprocess.run([*peers.KILN, "generate", args.model, "--prompt", "Hi", "--max-tokens", "1"], check=True)
    print(
        f"{args.decoders} streams decode {args.decode_len} tokens; {args.long} prompts of {args.long_len} "
        f"tokens arrive once they all stream; load {os.getloadavg()[0]:.2f} (1-min avg)"
    )
    header = (
        f"{'server':<44}{'during p50':>11}{'p99':>8}{'p99/p50':>8}{'all p50':>9}{'p99':>8}{'p99/p50':>8}"
        f"{'long ttft':>10}{'tok/s':>8}{'peak MiB':>9}"
    )
    lines = []
    for name, command in rows:
        if any(word in name for word in args.skip):
            continue
        if command[0] == str(peers.LLAMA_SERVER) and not peers.LLAMA_SERVER.is_file():
            print(f"{name}: skipped, {peers.LLAMA_SERVER} is missing (make bench-peers builds it)")
            continue
        process, _ = peers.start(command, port, work / f"server-{len(lines)}.log")
        try:
            row = asyncio.run(run(f"http://127.0.0.1:{port}", args, process.pid))
        finally:
            peers.stop(process)
        lines.append(
            f"{name:<44}{row['during_p50'] * 1e3:>11.1f}{row['during_p99'] * 1e3:>8.1f}"
            f"{row['during_p99'] / row['during_p50']:>8.2f}{row['all_p50'] * 1e3:>9.1f}"
            f"{row['all_p99'] * 1e3:>8.1f}{row['all_p99'] / row['all_p50']:>8.2f}"
            f"{row['long_ttft_max']:>10.2f}{row['tok_s']:>8.1f}{row['peak_rss_mib']:>9.0f}"
        )
        print(f"{name}: done, long prompts computed in {row['window_s']:.2f} s; failed {row['failed']}")
    print(
        "\ngaps of the decoding streams in ms (during: while the long prompts were computed; all: the whole"
    )
    print(f"run); long ttft: the last long prompt's first token, s; load {os.getloadavg()[0]:.2f} at the end")
    print(header)
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
