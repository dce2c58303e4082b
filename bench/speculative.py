"""Single-stream decode with and without n-gram speculative decoding, on input-grounded tasks.

    .venv/bin/python bench/speculative.py [--models smollm2-135m-instruct qwen2.5-coder-0.5b-instruct]
        [--k 3] [--tokens 128] [--repeats 3]

For each model and task (rewrite code with one change; quote a passage), greedy, through kiln.LLM on
the default artifact: output tokens/s of the whole generation (medians of --repeats), the speedup, the
draft acceptance rate, and whether the tokens are identical (they must be). --k 3 keeps a speculating
step within the TVM artifact's single-stream `decode` function (4 token rows). Then the cost of one
step of k + 1 rows against one of 1 row (one sequence at context 300, median of 30).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

CODE = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


def main():
    for i in range(10):
        print(i, fibonacci(i))


if __name__ == "__main__":
    main()
'''
PASSAGE = (
    "Kiln compiles a model once, ahead of time, into an artifact per target, and serves it from a small "
    "runtime. The artifact holds the compiled step, the weights in the layouts the kernels read, the "
    "tokenizer and a manifest of checksums. Loading refuses an artifact whose files do not match."
)
TASKS = {
    "rewrite code": "Rewrite this code so that the function fibonacci is named fib, changing nothing "
    f"else:\n\n{CODE}",
    "quote passage": f"Repeat this passage word for word, then give it a title.\n\n{PASSAGE}",
}


def step_ms(executable: Any, rows: int, context: int = 300) -> float:
    """The median time of a step computing `rows` tokens of one sequence at `context` tokens."""
    from kiln.runtime.step_builder import SequenceSlice, build_step_inputs

    cache = executable.kv_cache_spec.allocate(64, 16)
    table = list(range(1, 1 + (context + rows) // 16 + 1))
    executable.step(build_step_inputs([SequenceSlice(list(range(100, 100 + context)), 0, table)], 16), cache)
    tokens = list(range(500, 500 + rows))
    inputs = build_step_inputs([SequenceSlice(tokens, context, table, list(range(rows)))], 16)
    for _ in range(3):
        executable.step(inputs, cache)
    runs = []
    for _ in range(30):
        start = time.perf_counter()
        executable.step(inputs, cache)
        runs.append(time.perf_counter() - start)
    return 1000 * statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
    )
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import kiln

    load_start = os.getloadavg()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4}
    rows = []
    step_costs = []
    for model in args.models:
        engines = {
            name: kiln.LLM(model, max_num_seqs=1, speculative_config=config, show_progress=False)
            for name, config in (("plain", None), ("ngram", spec))
        }
        tokenizer = engines["plain"].get_tokenizer()
        executable = engines["plain"].artifact.executable
        step_costs.append((model, step_ms(executable, 1), step_ms(executable, args.k + 1)))
        params = kiln.SamplingParams(temperature=0, max_tokens=args.tokens)
        for task, text in TASKS.items():
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True
            )
            prompt = tokenizer.encode(chat, add_special_tokens=False)
            speeds: dict[str, float] = {}
            tokens: dict[str, list[int]] = {}
            acceptance = 0.0
            for name, llm in engines.items():
                llm.generate(prompt, params)  # warm up
                stats = llm.engine.stats
                drafted, accepted = stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens
                runs = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    output = llm.generate(prompt, params)[0].outputs[0]
                    runs.append(len(output.token_ids) / (time.perf_counter() - start))
                    tokens[name] = output.token_ids
                speeds[name] = statistics.median(runs)
                if name == "ngram":
                    new_drafts = stats.num_spec_draft_tokens - drafted
                    acceptance = (
                        (stats.num_spec_accepted_tokens - accepted) / new_drafts if new_drafts else 0.0
                    )
            rows.append(
                (
                    model,
                    task,
                    len(tokens["plain"]),
                    speeds["plain"],
                    speeds["ngram"],
                    acceptance,
                    tokens["plain"] == tokens["ngram"],
                )
            )

    print(f"greedy, single stream, {args.tokens} tokens at most, k = {args.k}, medians of {args.repeats}")
    print(
        f"load average {load_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; {os.cpu_count()} CPUs"
    )
    print(
        f"{'model':<30}{'task':<16}{'tokens':>7}{'plain':>9}{'ngram':>9}{'speedup':>9}{'accepted':>10}  same"
    )
    for model, task, count, plain, ngram, acceptance, same in rows:
        print(
            f"{model:<30}{task:<16}{count:>7}{plain:>9.1f}{ngram:>9.1f}{ngram / plain:>8.2f}x"
            f"{100 * acceptance:>9.0f}%  {'yes' if same else 'NO'}"
        )
    print(f"\none step, one sequence at context 300: 1 row against {args.k + 1} rows (ms)")
    for model, one, many in step_costs:
        print(f"{model:<30}{one:>8.2f}{many:>8.2f}  x{many / one:.2f}")


if __name__ == "__main__":
    main()
