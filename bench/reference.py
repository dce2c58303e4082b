"""Reference backend on SmolLM2: capture time, prefill and decode tokens/s, peak memory.

    .venv/bin/python bench/reference.py [--model NAME] [--prompt-len 128] [--decode-len 32] [--repeats 3]

Prints a table of medians, with transformers float32 on the same weights beside it (same process,
measured one after the other) and the ratio. The reference backend is the oracle, not the fast path.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch

from kiln.compiler.build import build_reference
from kiln.ir.step import SequenceSlice, build_step_inputs

BLOCK_SIZE = 16


def _kiln_prefill_decode(built, prompt: list[int], decode_len: int) -> tuple[float, float]:
    total = len(prompt) + decode_len
    num_blocks = (total + BLOCK_SIZE - 1) // BLOCK_SIZE
    kv_cache = built.executable.kv_cache_spec.allocate(num_blocks, BLOCK_SIZE)
    table = list(range(num_blocks))
    start = time.perf_counter()
    logits = built.executable.step(build_step_inputs([SequenceSlice(prompt, 0, table)], BLOCK_SIZE), kv_cache)
    prefill_s = time.perf_counter() - start
    token, cached = int(logits[0].argmax()), len(prompt)
    start = time.perf_counter()
    for _ in range(decode_len):
        inputs = build_step_inputs([SequenceSlice([token], cached, table)], BLOCK_SIZE)
        token = int(built.executable.step(inputs, kv_cache)[0].argmax())
        cached += 1
    return len(prompt) / prefill_s, decode_len / (time.perf_counter() - start)


def _hf_prefill_decode(model, prompt: list[int], decode_len: int) -> tuple[float, float]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        start = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill_s = time.perf_counter() - start
        past, token = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
        start = time.perf_counter()
        for _ in range(decode_len):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
    return len(prompt) / prefill_s, decode_len / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-peer", action="store_true", help="skip the transformers comparison")
    args = parser.parse_args()

    print(f"load: {os.getloadavg()[0]:.2f} (1-min average), torch threads {torch.get_num_threads()}")
    built = build_reference(args.model)
    prompt = torch.randint(
        100, built.config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)
    )
    prompt_ids = prompt.tolist()
    kiln = [_kiln_prefill_decode(built, prompt_ids, args.decode_len) for _ in range(args.repeats)]
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    rows = [("kiln reference", statistics.median(p for p, _ in kiln), statistics.median(d for _, d in kiln))]
    if not args.no_peer:
        import transformers

        from kiln.frontend.pull import resolve_model

        path = resolve_model(args.model)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
        peer = [_hf_prefill_decode(hf, prompt_ids, args.decode_len) for _ in range(args.repeats)]
        rows.append(
            (
                "transformers fp32",
                statistics.median(p for p, _ in peer),
                statistics.median(d for _, d in peer),
            )
        )

    times = built.seconds
    print(
        f"model {built.name}: load {times['load']:.2f} s (dequantize {times['dequantize']:.2f} s of it), "
        f"capture {times['capture']:.2f} s, peak RSS after kiln runs {peak_mib:.0f} MiB"
    )
    print(f"prompt {args.prompt_len} tokens, decode {args.decode_len} tokens, median of {args.repeats}")
    print(f"{'engine':<20}{'prefill tok/s':>15}{'decode tok/s':>14}{'prefill ratio':>15}{'decode ratio':>14}")
    base_prefill, base_decode = rows[-1][1], rows[-1][2]
    for name, prefill, decode in rows:
        ratios = f"{prefill / base_prefill:>15.2f}{decode / base_decode:>14.2f}"
        print(f"{name:<20}{prefill:>15.1f}{decode:>14.1f}{ratios}")


if __name__ == "__main__":
    main()
