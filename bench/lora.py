"""LoRA adapters: what serving them costs, beside llama.cpp with the same GGUF adapter.

    .venv/bin/python bench/lora.py [--model smollm2-135m-instruct] [--rank 16] [--output-len 64]
        [--repeats 3] [--llama-server .venv-peers/llama.cpp/bin/llama-server]

Makes 4 random rank-`--rank` adapters for the model (scripts/make_lora.py: PEFT folders and llama.cpp's
GGUFs of them), compiles the model twice on the default path (TVM for this CPU), without and with
--enable-lora, and measures, interleaved, medians over `--repeats`:

- decode tok/s of 1 and 16 streams on the base model: LoRA disabled against LoRA enabled (every row
  slot -1; the goal: within 3%);
- 16 streams over the 4 adapters (4 each) against the base-only 16 streams (the goal: >= 0.8x);
- 1 stream with 1 adapter, beside llama-server with `--lora` on the same GGUF and adapter GGUF (its
  `timings.predicted_per_second`), both at 2 threads;
- the time to load an adapter (read, check, copy into a slot), from its PEFT folder and its GGUF;
- peak RSS of this process, and the machine's load.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from serve_peers import free_port, start, stop  # bench/serve_peers.py

REPO = Path(__file__).resolve().parents[1]
PROMPT_LEN = 16


def make_adapters(model_path: Path, out: Path, rank: int, source: Path) -> list[Path]:
    if not (out / "lora-3.gguf").exists():
        command = [sys.executable, str(REPO / "scripts/make_lora.py"), str(model_path), str(out)]
        command += ["--rank", str(rank), "--count", "4", "--gguf", str(source)]
        subprocess.run(command, check=True, capture_output=True)
    return [out / f"lora-{i}" for i in range(4)]


def decode_rate(llm, streams: int, output_len: int, loras) -> float:  # type: ignore[no-untyped-def]
    import kiln

    prompts = [[(17 * s + 5 * i) % 4000 + 100 for i in range(PROMPT_LEN)] for s in range(streams)]
    params = kiln.SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, lora_request=loras)
    return streams * output_len / (time.perf_counter() - start)


def llama_server_rate(
    server: Path, gguf: Path, adapter: Path | None, output_len: int, repeats: int, log: Path
) -> float:
    port = free_port()
    command = [str(server), "-m", str(gguf), "--port", str(port), "-t", "2", "-c", "1024", "-np", "1"]
    if adapter is not None:
        command += ["--lora", str(adapter)]
    process, _ = start(command, port, log)
    try:
        url = f"http://127.0.0.1:{port}"
        rates = []
        for repeat in range(repeats + 1):
            prompt = [(5 * i + repeat) % 4000 + 100 for i in range(PROMPT_LEN)]
            body = {
                "prompt": prompt,
                "n_predict": output_len,
                "temperature": 0,
                "ignore_eos": True,
                "cache_prompt": False,
            }
            answer = httpx.post(f"{url}/completion", json=body, timeout=600).json()
            if repeat:  # the first warms up
                rates.append(answer["timings"]["predicted_per_second"])
        return statistics.median(rates)
    finally:
        stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-server", type=Path, default=REPO / ".venv-peers/llama.cpp/bin/llama-server")
    args = parser.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", "2")

    import kiln
    from kiln.frontend.pull import kiln_home, pull
    from kiln.runtime.lora import LoRARequest

    model_path = pull(args.model)
    source = next((kiln_home() / "llama.cpp-source").glob("*/vendor/llama.cpp"))
    adapters = make_adapters(
        model_path, kiln_home() / "bench-lora" / f"{args.model}-r{args.rank}", args.rank, source
    )
    requests = [LoRARequest(f"lora-{i}", i + 1, str(path)) for i, path in enumerate(adapters)]

    plain = kiln.LLM(args.model, show_progress=False)
    lora = kiln.LLM(args.model, enable_lora=True, max_lora_rank=args.rank, max_loras=4, show_progress=False)
    load_peft, load_gguf = [], []
    for i, path in enumerate(adapters):
        for suffix, target, times in (("", path, load_peft), (".gguf", path.with_suffix(".gguf"), load_gguf)):
            started = time.perf_counter()
            lora.engine.add_lora(LoRARequest(f"load-{i}{suffix}", 100 + i, str(target)))
            slots = lora.engine.adapters
            assert slots is not None
            slots.acquire(f"load-{i}{suffix}")  # the copy into a slot is part of loading
            slots.release(f"load-{i}{suffix}")
            times.append(time.perf_counter() - started)
    sixteen_mixed = [requests[s % 4] for s in range(16)]
    cases = {
        "1 stream, LoRA disabled": (plain, 1, None),
        "1 stream, LoRA enabled, base": (lora, 1, None),
        "1 stream, 1 adapter": (lora, 1, requests[0]),
        "16 streams, LoRA disabled": (plain, 16, None),
        "16 streams, LoRA enabled, base": (lora, 16, None),
        "16 streams over 4 adapters": (lora, 16, sixteen_mixed),
    }
    for llm, streams, loras in cases.values():  # warm up: first steps, adapters into slots
        decode_rate(llm, streams, 8, loras)
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, (llm, streams, loras) in cases.items():
            rates[name].append(decode_rate(llm, streams, args.output_len, loras))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    peers = {}
    if args.llama_server.exists():
        for name, adapter in (("no adapter", None), ("--lora", adapters[0].with_suffix(".gguf"))):
            log = adapters[0].parent / f"llama-server-{'lora' if adapter else 'base'}.log"
            peers[f"llama-server 1 stream, {name}"] = llama_server_rate(
                args.llama_server, model_path, adapter, args.output_len, args.repeats, log
            )
    load = os.getloadavg()
    print(
        f"\n{args.model}, rank {args.rank}, {args.output_len} tokens a stream, {PROMPT_LEN}-token prompts, "
        f"TVM threads {os.environ['TVM_NUM_THREADS']}, medians of {args.repeats}; load {load[0]:.2f}"
    )
    print(f"{'case':40} {'tok/s':>9} {'ratio':>7}")
    baseline = {1: medians["1 stream, LoRA disabled"], 16: medians["16 streams, LoRA disabled"]}
    for name, value in medians.items():
        streams = 16 if name.startswith("16") else 1
        print(f"{name:40} {value:9.1f} {value / baseline[streams]:6.3f}x")
    for name, value in peers.items():
        print(f"{name:40} {value:9.1f}")
    if len(peers) == 2:
        ratio = medians["1 stream, 1 adapter"] / peers["llama-server 1 stream, --lora"]
        print(f"{'kiln 1 adapter / llama-server --lora':40} {ratio:9.3f}x")
    print(
        f"adapter load (read, check, copy to a slot): PEFT folder {statistics.median(load_peft) * 1000:.0f} "
        f"ms, GGUF {statistics.median(load_gguf) * 1000:.0f} ms (medians of 4)"
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of this process (two compiled models, 8 adapters): {peak:.0f} MiB")


if __name__ == "__main__":
    main()
