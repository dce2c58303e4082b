"""Decode tokens/s at TP 1 against TP 2 (or --tp), and what the ranks exchange a step.

    .venv/bin/python bench/tensor_parallel.py [--model smollm2-135m-instruct] [--tp 2] [--streams 1 4]
        [--tokens 32] [--backend tvm|reference] [--quantization none|int8|int4|gguf]

Float32 activations (TVM for this CPU by default, compiled into the cache at each size), greedy, EOS
ignored. On rank 0
(the engine's process) every `torch.distributed` call is timed and its tensor's bytes counted; the
table gives, per decode step, the time in collectives and the bytes rank 0 puts into them, beside
the formula: per step of T token rows and L logits rows, 2 n + 1 all_reduces of T x H float32 (two
a layer, one for the embedding), one all_gather of L x V / tp float32, and the broadcast of the step's
inputs (64 bytes of header, 8 (3 T + B x MB + 2 B + 1 + L) of payload for B sequences of MB blocks);
TVM pads T and L to multiples of 4. Each size runs in its own process. On a machine with fewer cores
than ranks expect no speedup: the ranks share the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

import torch.distributed as dist


class Counted:
    """Wraps torch.distributed's collectives in this process: time and bytes per kind, and each step's
    token and logits rows (read from the header rank 0 broadcasts)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, int] = defaultdict(int)
        self.step_rows: list[tuple[int, int]] = []
        for name in ("all_reduce", "all_gather", "broadcast"):
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, function: Any) -> Any:
        from kiln.runtime.tensor_parallel import HEADER, STEP

        def timed(*args: Any, **kwargs: Any) -> Any:
            tensor = args[1] if name == "all_gather" else args[0]
            if name == "broadcast" and tensor.numel() == HEADER and int(tensor[0]) == STEP:
                self.step_rows.append((int(tensor[1]), int(tensor[4])))
            start = time.perf_counter()
            result = function(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - start
            self.bytes[name] += tensor.numel() * tensor.element_size()
            return result

        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.bytes.clear()
        self.step_rows.clear()


def _padded(rows: int, backend: str) -> int:
    """The rows a step computes: TVM pads token and logits rows to multiples of 4."""
    return -(-rows // 4) * 4 if backend == "tvm" else rows


def measure(args: argparse.Namespace, tp: int) -> list[dict[str, Any]]:
    """This process runs the model at `tp` (a TVM thread pool sizes itself once, so one size a process)."""
    counted = Counted()
    import kiln

    llm = kiln.LLM(
        args.model,
        backend=args.backend,
        quantization=args.quantization,
        tensor_parallel_size=tp,
        show_progress=False,
    )
    config = llm.artifact.manifest["model"]["config"]
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    rows = []
    for streams in args.streams:
        prompts = [f"Story {i}: once upon a time" for i in range(streams)]
        params = kiln.SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        llm.generate(prompts, kiln.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        counted.reset()
        stats = llm.engine.stats
        steps_before = stats.num_steps
        start = time.perf_counter()
        llm.generate(prompts, params)
        took = time.perf_counter() - start
        steps = max(1, stats.num_steps - steps_before)
        reduce_formula = sum(
            (2 * layers + 1) * _padded(t, args.backend) * hidden * 4 for t, _ in counted.step_rows
        )
        gather_formula = sum(_padded(n, args.backend) * (vocab // tp) * 4 for _, n in counted.step_rows)
        rows.append(
            {
                "tp": tp,
                "streams": streams,
                "tok/s": streams * args.tokens / took,
                "steps": steps,
                "comm ms/step": 1000 * sum(counted.seconds.values()) / steps,
                "all_reduce B/step": counted.bytes.get("all_reduce", 0) / steps,
                "all_reduce formula": reduce_formula / steps,
                "all_gather B/step": counted.bytes.get("all_gather", 0) / steps,
                "all_gather formula": gather_formula / steps,
                "broadcast B/step": counted.bytes.get("broadcast", 0) / steps,
                "hidden": hidden,
            }
        )
    llm.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--backend", choices=["tvm", "reference"], default="tvm")
    parser.add_argument("--quantization", choices=["none", "int8", "int4", "gguf"], default="none")
    parser.add_argument("--only-tp", type=int, default=None, help=argparse.SUPPRESS)  # one size, as JSON
    args = parser.parse_args()
    if args.only_tp is not None:
        print(json.dumps(measure(args, args.only_tp)))
        return

    load_start = os.getloadavg()[0]
    rows = []
    for tp in (1, args.tp):
        command = [sys.executable, *sys.argv, "--only-tp", str(tp)]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        rows += json.loads(output.strip().splitlines()[-1])
    print(
        f"{args.model}, {args.backend}, quantization {args.quantization}, greedy, "
        f"{args.tokens} tokens a stream"
    )
    print(f"load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end; {os.cpu_count()} CPUs")
    columns = [name for name in rows[0] if name != "hidden"]
    print("".join(f"{name:>{max(7, len(name) + 2)}}" for name in columns))
    for row in rows:
        print("".join(_cell(row[name], max(7, len(name) + 2)) for name in columns))
    print("(averages over every step of the run, its prefill included; the formulas from its steps' rows)")
    hidden = int(rows[0]["hidden"]) if "hidden" in rows[0] else 896
    latency = _bare_all_reduce_us(args.tp, hidden)
    print(f"a bare gloo all_reduce of {hidden} float32 between {args.tp} processes here: {latency:.0f} us")


def _bare_all_reduce_us(world: int, numel: int) -> float:
    """The median time of one all_reduce between `world` fresh processes: the floor under comm ms/step."""
    import torch.multiprocessing

    context = torch.multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    port = _free_port()
    torch.multiprocessing.start_processes(
        _bare_rank, args=(world, port, numel, results), nprocs=world, start_method="spawn"
    )
    return float(results.get())


def _bare_rank(rank: int, world: int, port: int, numel: int, results: Any) -> None:
    import statistics

    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tensor = torch.ones(numel)
    times = []
    for _ in range(220):
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    if rank == 0:
        results.put(statistics.median(times[20:]) * 1e6)
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _cell(value: float, width: int) -> str:
    return f"{value:>{width}}" if isinstance(value, int) else f"{value:>{width}.1f}"


if __name__ == "__main__":
    main()
