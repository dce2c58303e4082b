"""Single-stream decode with and without speculative decoding (n-gram, draft model).

    .venv/bin/python bench/speculative.py [--models smollm2-135m-instruct qwen2.5-coder-0.5b-instruct]
        [--draft-pairs qwen2.5-coder-1.5b-instruct=qwen2.5-coder-0.5b-instruct] [--k 3] [--tokens 128]
        [--repeats 3]

n-gram runs on each of --models; each TARGET=DRAFT pair runs plain, n-gram and the draft model on the
target. The tasks: two input-grounded ones (rewrite code with one change; quote a passage) and one
free-form one (write new code), where prompt lookup has little to find. Greedy, through kiln.LLM on the
default artifacts: output tokens/s of the whole generation (medians of --repeats), the speedup, the draft
acceptance rate, and whether the tokens are identical (they must be). --k 3 keeps a speculating step
within the TVM artifact's single-stream `decode` function (4 token rows). Then the cost of one step of
k + 1 rows against one of 1 row (one sequence at context 300, median of 30).
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
    "new code": "Write a Python function that returns the prime numbers below n, with a docstring.",
}
GROUNDED = ("rewrite code", "quote passage")


def step_ms(executable: Any, rows: int, context: int = 300) -> float:
    """The median time of a step computing `rows` tokens of one sequence at `context` tokens."""
    from kiln.backends.base import allocate_kv_cache
    from kiln.ir.step import SequenceSlice, build_step_inputs

    cache = allocate_kv_cache(executable, 64, 16)
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


def measure(llm: Any, prompt: list[int], params: Any, repeats: int) -> tuple[float, float, list[int]]:
    """Median tokens/s, the acceptance rate of the timed runs' drafts, and the tokens."""
    llm.generate(prompt, params)  # warm up
    stats = llm.engine.stats.speculative
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    runs = []
    tokens: list[int] = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = llm.generate(prompt, params)[0].outputs[0].token_ids
        runs.append(len(tokens) / (time.perf_counter() - start))
    new_drafts = stats.num_draft_tokens - drafted
    acceptance = (stats.num_accepted_tokens - accepted) / new_drafts if new_drafts else 0.0
    return statistics.median(runs), acceptance, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--models", nargs="*", default=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
    )
    parser.add_argument(
        "--draft-pairs", nargs="*", default=["qwen2.5-coder-1.5b-instruct=qwen2.5-coder-0.5b-instruct"]
    )
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import kiln

    load_start = os.getloadavg()
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4}
    runs: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
        (m, {"ngram": ngram}, GROUNDED) for m in args.models
    ]
    for pair in args.draft_pairs:
        target, draft = pair.split("=")
        methods = {"ngram": ngram, f"draft {draft}": {"model": draft, "num_speculative_tokens": args.k}}
        runs.append((target, methods, tuple(TASKS)))
    rows = []
    step_costs = []
    for model, methods, tasks in runs:
        plain = kiln.LLM(model, max_num_seqs=1, show_progress=False)
        engines = {
            name: kiln.LLM(model, max_num_seqs=1, speculative_config=config, show_progress=False)
            for name, config in methods.items()
        }
        tokenizer = plain.get_tokenizer()
        if model not in [m for m, _, _ in step_costs]:
            executable = plain.artifact.executable
            step_costs.append((model, step_ms(executable, 1), step_ms(executable, args.k + 1)))
        params = kiln.SamplingParams(temperature=0, max_tokens=args.tokens)
        for task in tasks:
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": TASKS[task]}], add_generation_prompt=True
            )
            prompt = tokenizer.encode(chat, add_special_tokens=False)
            base_speed, _, base_tokens = measure(plain, prompt, params, args.repeats)
            for name, llm in engines.items():
                speed, acceptance, tokens = measure(llm, prompt, params, args.repeats)
                rows.append(
                    (model, name, task, len(tokens), base_speed, speed, acceptance, tokens == base_tokens)
                )
        del plain, engines

    print(f"greedy, single stream, {args.tokens} tokens at most, k = {args.k}, medians of {args.repeats}")
    print(
        f"load average {load_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; {os.cpu_count()} CPUs"
    )
    print(
        f"{'model':<30}{'method':<36}{'task':<15}{'tokens':>7}{'plain':>8}{'spec':>8}{'speedup':>9}"
        f"{'accepted':>10}  same"
    )
    for model, method, task, count, base, speed, acceptance, same in rows:
        print(
            f"{model:<30}{method:<36}{task:<15}{count:>7}{base:>8.1f}{speed:>8.1f}{speed / base:>8.2f}x"
            f"{100 * acceptance:>9.0f}%  {'yes' if same else 'NO'}"
        )
    print(f"\none step, one sequence at context 300: 1 row against {args.k + 1} rows (ms)")
    for model, one, many in step_costs:
        print(f"{model:<30}{one:>8.2f}{many:>8.2f}  x{many / one:.2f}")


if __name__ == "__main__":
    main()
