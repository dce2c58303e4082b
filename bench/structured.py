"""The cost of structured outputs: decode with 16 constrained streams against 16 unconstrained ones, and
the compile time of the test suite's 50 JSON schemas.

    .venv/bin/python bench/structured.py [--model smollm2-135m-instruct] [--streams 16] [--tokens 128]
        [--repeats 3]

Both runs generate --tokens tokens in each of --streams sequences through kiln.LLM (the default
artifact): unconstrained with ignore_eos, constrained to a JSON array of exactly 100 bounded integers
(longer than --tokens, so every step of every row is masked). Reported: medians of --repeats, the
milliseconds a step (all rows), and the constrained/unconstrained ratio; then the 50 schemas' compile
times (a fresh compiler: the first compile also builds the vocabulary's tables, reported apart).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

SCHEMAS = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "json_schemas.json"
LONG_ARRAY = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 999},
    "minItems": 100,
    "maxItems": 100,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import kiln
    from kiln.compiler.build import runtime_tokenizer
    from kiln.frontend.load import load_model
    from kiln.runtime.structured_output import Grammars

    load_start = os.getloadavg()
    llm = kiln.LLM(args.model, max_num_seqs=args.streams, show_progress=False)
    prompts = [f"List {args.streams + i} numbers as a JSON array:" for i in range(args.streams)]
    plain = kiln.SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    constrained = kiln.SamplingParams(
        temperature=0, max_tokens=args.tokens, structured_output=kiln.StructuredOutput.json_schema(LONG_ARRAY)
    )

    def per_step(params: kiln.SamplingParams) -> float:
        steps_before = llm.engine.stats.num_steps
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        took = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == args.tokens for o in outputs)
        return 1000 * took / (llm.engine.stats.num_steps - steps_before)

    per_step(plain)  # warm up
    per_step(constrained)
    runs = {"unconstrained": [], "constrained": []}
    for _ in range(args.repeats):
        runs["unconstrained"].append(per_step(plain))
        runs["constrained"].append(per_step(constrained))
    medians = {name: statistics.median(times) for name, times in runs.items()}

    source = load_model(args.model)
    grammars = Grammars(runtime_tokenizer(source), source.config.vocab_size)
    schemas = json.loads(SCHEMAS.read_text())
    start = time.perf_counter()
    grammars.compile(kiln.StructuredOutput.json_schema({"type": "object"}))  # builds the vocabulary tables
    tables = time.perf_counter() - start
    compile_ms = []
    for schema in schemas:
        start = time.perf_counter()
        grammars.compile(kiln.StructuredOutput.json_schema(schema))
        compile_ms.append(1000 * (time.perf_counter() - start))
    grammars.shutdown()

    print(f"{args.model}: {args.streams} streams x {args.tokens} tokens, greedy, medians of {args.repeats}")
    print(
        f"load average {load_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; {os.cpu_count()} CPUs"
    )
    print(f"{'run':<16}{'ms a step':>10}")
    for name, value in medians.items():
        print(f"{name:<16}{value:>10.2f}")
    ratio = medians["constrained"] / medians["unconstrained"]
    print(f"constrained / unconstrained: {ratio:.3f} ({100 * (ratio - 1):+.1f}%)")
    print(
        f"compile of {len(schemas)} schemas: median {statistics.median(compile_ms):.2f} ms, "
        f"max {max(compile_ms):.2f} ms (vocabulary tables once: {1000 * tables:.0f} ms)"
    )


if __name__ == "__main__":
    main()
