"""One long prompt through `kiln.LLM` (chunked prefill), then greedy tokens: the wall time, beside
what `llama-bench -p P -n N` reports for the same GGUF (pp and tg tok/s, add the two times).

    .venv/bin/python bench/long_context.py [--model smollm2-135m-instruct] [-p 6000] [-n 32] [-r 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("-p", "--prompt-len", type=int, default=6000)
    parser.add_argument("-n", "--decode-len", type=int, default=32)
    parser.add_argument("-r", "--repeats", type=int, default=1)
    args = parser.parse_args()
    import kiln

    llm = kiln.LLM(args.model, max_num_seqs=1, max_model_len=args.prompt_len + args.decode_len + 16)
    params = kiln.SamplingParams(temperature=0, max_tokens=args.decode_len, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 30000, (args.prompt_len,), generator=generator).tolist()
    llm.generate([prompt[:64]], params)  # warm up
    print(f"load {os.getloadavg()[0]:.2f}; {args.model}: {args.prompt_len}-token prompt + {args.decode_len}")
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        (output,) = llm.generate([prompt], params)
        seconds.append(time.perf_counter() - start)
        assert len(output.outputs[0].token_ids) == args.decode_len
    print(f"{statistics.median(seconds):.2f} s (median of {args.repeats}); load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
