"""ONNX Runtime (CPU) on SmolLM2: prefill tok/s, single-stream decode tok/s, 16-stream throughput,
for float32 and int4 (MatMulNBits); rows for bench/compare.py.

    .venv/bin/python bench/onnxruntime_rows.py [--model NAME] [--prompt-len 512] [--decode-len 128]
        [--streams 16] [--stream-input-len 128] [--stream-output-len 128] [--repeats 1]

Each variant is compiled once (`kiln compile --backend onnxruntime`) into a temporary artifact and
loaded as `kiln generate` would. Prefill is one step over the whole prompt; decode is greedy steps of
one token after it; throughput runs `streams` requests through one LLMEngine (EOS ignored) and
counts output tokens per second of the whole run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kiln.backends.targets import Target
from kiln.compiler import CompileOptions, compile_model
from kiln.runtime.artifact import LoadedArtifact, load_artifact
from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import LLMEngine
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import SchedulerConfig
from kiln.runtime.step_builder import SequenceSlice, build_step_inputs

BLOCK_SIZE = 16
VARIANTS = {"float32": None, "int4": "int4"}


def _prefill_decode(artifact: LoadedArtifact, prompt: list[int], decode_len: int) -> tuple[float, float]:
    executable = artifact.executable
    num_blocks = -(-(len(prompt) + decode_len) // BLOCK_SIZE)
    cache = executable.kv_cache_spec.allocate(num_blocks, BLOCK_SIZE)
    table = list(range(num_blocks))
    start = time.perf_counter()
    logits = executable.step(build_step_inputs([SequenceSlice(prompt, 0, table)], BLOCK_SIZE), cache)
    prefill_s = time.perf_counter() - start
    token, cached = int(logits[0].argmax()), len(prompt)
    start = time.perf_counter()
    for _ in range(decode_len):
        inputs = build_step_inputs([SequenceSlice([token], cached, table)], BLOCK_SIZE)
        token = int(executable.step(inputs, cache)[0].argmax())
        cached += 1
    return len(prompt) / prefill_s, decode_len / (time.perf_counter() - start)


def _throughput(artifact: LoadedArtifact, prompts: list[list[int]], output_len: int) -> float:
    config = EngineConfig(num_blocks=1024, scheduler=SchedulerConfig(max_num_seqs=len(prompts)))
    engine = LLMEngine(artifact.executable, artifact.tokenizer, artifact.model_id, 2048, config)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs = engine.run_to_completion()
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def onnxruntime_rows(
    model: str = "smollm2-135m-instruct",
    prompt_len: int = 512,
    decode_len: int = 128,
    streams: int = 16,
    stream_input_len: int = 128,
    stream_output_len: int = 128,
    repeats: int = 1,
    variants: tuple[str, ...] = tuple(VARIANTS),
    num_threads: int | None = None,
) -> list[dict[str, Any]]:
    """One row per variant: {"engine", "prefill_tok_s", "decode_tok_s", "streams", "throughput_tok_s",
    "compile_s", "threads", "load_avg"}; medians over `repeats`."""
    rows = []
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="kiln-ort-bench-") as scratch:
        for variant in variants:
            folder = Path(scratch) / variant
            options = CompileOptions(
                backend="onnxruntime",
                quantization=VARIANTS[variant],
                max_num_seqs=streams,
                num_threads=num_threads,
            )
            start = time.perf_counter()
            compile_model(model, [Target("cpu")], options, folder)
            compile_s = time.perf_counter() - start
            artifact = load_artifact(folder)
            vocab = artifact.tokenizer.vocab_size
            prompt = torch.randint(100, vocab, (prompt_len,), generator=generator).tolist()
            _prefill_decode(artifact, prompt[:32], 4)  # warm up (session allocations)
            measured = [_prefill_decode(artifact, prompt, decode_len) for _ in range(repeats)]
            throughput = []
            for _ in range(repeats):
                prompts = [
                    torch.randint(100, vocab, (stream_input_len,), generator=generator).tolist()
                    for _ in range(streams)
                ]
                throughput.append(_throughput(artifact, prompts, stream_output_len))
            rows.append(
                {
                    "engine": f"onnxruntime cpu {variant}",
                    "prefill_tok_s": statistics.median(p for p, _ in measured),
                    "decode_tok_s": statistics.median(d for _, d in measured),
                    "streams": streams,
                    "throughput_tok_s": statistics.median(throughput),
                    "compile_s": compile_s,
                    "threads": num_threads or os.cpu_count(),
                    "load_avg": os.getloadavg()[0],
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-len", type=int, default=128)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-input-len", type=int, default=128)
    parser.add_argument("--stream-output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    rows = onnxruntime_rows(
        args.model,
        args.prompt_len,
        args.decode_len,
        args.streams,
        args.stream_input_len,
        args.stream_output_len,
        args.repeats,
        num_threads=args.num_threads,
    )
    print(
        f"prompt {args.prompt_len}, decode {args.decode_len}, {args.streams} streams of "
        f"{args.stream_input_len} in / {args.stream_output_len} out, median of {args.repeats}"
    )
    print(f"{'engine':<28}{'prefill tok/s':>15}{'decode tok/s':>14}{'N-stream tok/s':>16}{'load':>7}")
    for row in rows:
        print(
            f"{row['engine']:<28}{row['prefill_tok_s']:>15.1f}{row['decode_tok_s']:>14.1f}"
            f"{row['throughput_tok_s']:>16.1f}{row['load_avg']:>7.2f}"
        )


if __name__ == "__main__":
    main()
