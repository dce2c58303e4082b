"""Decode tokens/s at TP 1 against TP 2 (or --tp), and what the ranks exchange a step.

    .venv/bin/python bench/tensor_parallel.py [--model smollm2-135m-instruct] [--tp 2] [--streams 1 4]
        [--tokens 32] [--backend tvm|reference] [--quantization none|int8|int4]

Float32 activations (TVM for this CPU by default, compiled into the cache at each size), greedy, EOS
ignored. On rank 0
(the engine's process) every `torch.distributed` call is timed and its tensor's bytes counted; the
table gives, per decode step, the time in collectives and the bytes rank 0 puts into them, beside
the formula: per step of T token rows and L logits rows, 2 n + 1 all_reduces of T x H float32 (two
a layer, one for the embedding), one all_gather of L x V / tp float32, and the broadcast of the step's
inputs (64 bytes of header, 8 (3 T + B x MB + 2 B + 1 + L) of payload for B sequences of MB blocks).
On a machine with fewer cores than ranks expect no speedup: the ranks share the cores.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from typing import Any

import torch.distributed as dist


class Counted:
    """Wraps torch.distributed's collectives in this process: time and bytes per kind."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        for name in ("all_reduce", "all_gather", "broadcast"):
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, function: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            tensor = args[1] if name == "all_gather" else args[0]
            start = time.perf_counter()
            result = function(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - start
            self.bytes[name] += tensor.numel() * tensor.element_size()
            self.calls[name] += 1
            return result

        return timed

    def reset(self) -> None:
        for table in (self.seconds, self.bytes, self.calls):
            table.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--backend", choices=["tvm", "reference"], default="tvm")
    parser.add_argument("--quantization", choices=["none", "int8", "int4"], default="none")
    args = parser.parse_args()

    counted = Counted()
    import kiln

    load_start = os.getloadavg()[0]
    rows = []
    config = None
    for tp in (1, args.tp):
        llm = kiln.LLM(
            args.model,
            backend=args.backend,
            quantization=args.quantization,
            tensor_parallel_size=tp,
            show_progress=False,
        )
        config = llm.artifact.manifest["model"]["config"]
        for streams in args.streams:
            prompts = [f"Story {i}: once upon a time" for i in range(streams)]
            params = kiln.SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
            llm.generate(prompts, kiln.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
            counted.reset()
            stats = llm.engine.stats
            before = (stats.num_steps, stats.num_computed_tokens, stats.num_generation_tokens)
            start = time.perf_counter()
            llm.generate(prompts, params)
            took = time.perf_counter() - start
            steps, token_rows, logits_rows = (
                now - then
                for now, then in zip(
                    (stats.num_steps, stats.num_computed_tokens, stats.num_generation_tokens),
                    before,
                    strict=True,
                )
            )
            rows.append(
                (
                    tp,
                    streams,
                    streams * args.tokens / took,
                    steps,
                    token_rows,
                    logits_rows,
                    dict(counted.seconds),
                    dict(counted.bytes),
                )
            )
        llm.close()
        del llm

    assert config is not None
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    print(
        f"{args.model}, {args.backend}, quantization {args.quantization}, greedy, "
        f"{args.tokens} tokens a stream"
    )
    print(f"load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end; {os.cpu_count()} CPUs")
    print(
        f"{'tp':>3}{'streams':>8}{'tok/s':>9}{'steps':>7}{'comm ms/step':>14}{'all_reduce B/step':>19}"
        f"{'formula':>10}{'all_gather B/step':>19}{'formula':>10}{'broadcast B/step':>18}"
    )
    for tp, streams, speed, steps, token_rows, logits_rows, seconds, sent in rows:
        comm = 1000 * sum(seconds.values()) / max(1, steps)
        reduce_formula = (2 * layers + 1) * token_rows * hidden * 4 // max(1, steps)
        gather_formula = logits_rows * (vocab // tp) * 4 // max(1, steps)
        print(
            f"{tp:>3}{streams:>8}{speed:>9.1f}{steps:>7}{comm:>14.2f}"
            f"{sent.get('all_reduce', 0) / max(1, steps):>19.0f}{reduce_formula if tp > 1 else 0:>10}"
            f"{sent.get('all_gather', 0) / max(1, steps):>19.0f}{gather_formula if tp > 1 else 0:>10}"
            f"{sent.get('broadcast', 0) / max(1, steps):>18.0f}"
        )
    print("(averages over every step of the run, its prefill included; the formulas from its token rows)")


if __name__ == "__main__":
    main()
