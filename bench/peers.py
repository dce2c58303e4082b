"""Kiln beside its peers on the same GGUF, in one run: llama.cpp (llama-cpp-python) and transformers.

    make bench-peers            # sets up .venv-peers (kiln + llama-cpp-python + transformers), runs this
    .venv-peers/bin/python bench/peers.py [--model NAME] [--prompt-len 128] [--decode-len 64] [--repeats 3]

For each engine: prefill tokens/s of a --prompt-len prompt, and greedy decode tokens/s of batch 1
(EOS banned, so every run decodes the same count), medians of --repeats, with ratios against
llama.cpp. Threads: 2 for everyone. The load average is printed: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def _median_rates(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def bench_llama_cpp(
    path: str, prompt: list[int], decode_len: int, eos: int, repeats: int
) -> tuple[float, float]:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=2048, n_threads=2, n_batch=512, verbose=False)
    runs = []
    for _ in range(repeats):
        llm.reset()
        start = time.perf_counter()
        first = None
        count = 0
        for _chunk in llm.create_completion(
            prompt, max_tokens=decode_len, temperature=0.0, logit_bias={eos: -100.0}, stream=True
        ):
            count += 1
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        assert first is not None
        runs.append((len(prompt) / (first - start), (count - 1) / (end - first)))
    return _median_rates(runs)


def bench_transformers(path: str, prompt: list[int], decode_len: int, repeats: int) -> tuple[float, float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    runs = []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            out = model(torch.tensor([prompt]), use_cache=True)
            prefill = time.perf_counter() - start
            past, token = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
            start = time.perf_counter()
            for _ in range(decode_len - 1):
                out = model(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
            runs.append((len(prompt) / prefill, (decode_len - 1) / (time.perf_counter() - start)))
    return _median_rates(runs)


def bench_kiln(model: str, prompt: list[int], decode_len: int, repeats: int, quantization: str | None):
    from kiln.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    llm = LLM(model, num_blocks=64, quantization=quantization)
    params = SamplingParams(temperature=0, max_tokens=decode_len, ignore_eos=True)
    runs = []
    for index in range(repeats):
        engine = llm.engine
        engine.add_request(f"r{index}", prompt, params)
        start = time.perf_counter()
        first = None
        while engine.has_unfinished_requests():
            engine.step()
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        assert first is not None
        llm.engine.kv.pool.reset_prefix_cache()
        runs.append((len(prompt) / (first - start), (decode_len - 1) / (end - first)))
    return _median_rates(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)

    from kiln.frontend.pull import resolve_model

    path = str(resolve_model(args.model))
    vocab = 49152
    prompt = torch.randint(
        100, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    print(
        f"load {os.getloadavg()[0]:.2f} (1-min avg); {path}; prompt {args.prompt_len}, "
        f"decode {args.decode_len}, median of {args.repeats}, 2 threads"
    )
    rows = [
        (
            "llama.cpp (llama-cpp-python, Q4_1)",
            *bench_llama_cpp(path, prompt, args.decode_len, 2, args.repeats),
        )
    ]
    rows.append(("transformers (float32)", *bench_transformers(path, prompt, args.decode_len, args.repeats)))
    rows.append(
        ("kiln reference, float32", *bench_kiln(args.model, prompt, args.decode_len, args.repeats, None))
    )
    rows.append(
        ("kiln reference, gguf Q4_1", *bench_kiln(args.model, prompt, args.decode_len, args.repeats, "gguf"))
    )
    base_prefill, base_decode = rows[0][1], rows[0][2]
    print(f"{'engine':<36}{'prefill tok/s':>14}{'decode tok/s':>13}{'vs llama.cpp':>20}")
    for name, prefill, decode in rows:
        ratio = f"{prefill / base_prefill:.2f} / {decode / base_decode:.2f}"
        print(f"{name:<36}{prefill:>14.1f}{decode:>13.1f}{ratio:>20}")


if __name__ == "__main__":
    main()
