"""Record one engine run, byte for byte, to compare two versions of kiln: every step's inputs (each
array by name, its dtype, shape and sha256), its logits or hidden states (sha256), and every output
(tokens, text, logprobs, finish reasons, embeddings), then the engine's counters. A refactor that
changes no behaviour writes the same file.

    python scripts/record_engine_run.py OUT.json [--model smollm2-135m-instruct] [--backend tvm]

The run: greedy and seeded sampling, n=2, logprobs and prompt logprobs, stop strings, chunked prefill
and preemption (a small KV cache), an abort, and an embedding request, on the model's artifact.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np


def digest(array: Any) -> list[Any]:
    data = np.ascontiguousarray(np.asarray(array))
    return [str(data.dtype), list(data.shape), hashlib.sha256(data.tobytes()).hexdigest()[:16]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--backend", default="tvm")
    args = parser.parse_args()

    import kiln
    from kiln.runtime.sampling_params import SamplingParams

    llm = kiln.LLM(
        args.model,
        backend=args.backend,
        max_model_len=512,
        num_blocks=24,
        max_num_batched_tokens=64,
        show_progress=False,
    )
    executable = type(llm.engine.executable)
    steps: list[dict[str, Any]] = []
    original_step, original_embed = executable.step, executable.embed

    def recorded(kind: str, original: Any) -> Any:
        def run(self: Any, inputs: Any, kv_cache: Any) -> Any:
            result = original(self, inputs, kv_cache)
            given = {name: digest(array) for name, array in sorted(inputs.as_dict().items())}
            steps.append({"kind": kind, "inputs": given, "result": digest(result)})
            return result

        return run

    executable.step = recorded("step", original_step)
    executable.embed = recorded("embed", original_embed)
    engine = llm.engine
    prompts = [
        "The capital of France is",
        "Write a haiku about the sea.",
        "List three prime numbers:",
        "Once upon a time " * 20,
    ]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, prompt_logprobs=2)
    engine.add_request("greedy", prompts[0], greedy)
    engine.add_request("seeded", prompts[1], SamplingParams(max_tokens=40, temperature=0.8, seed=7, n=2))
    engine.add_request("stop", prompts[2], SamplingParams(max_tokens=40, stop=["7"], top_k=5, seed=3))
    engine.add_request("long", prompts[3], SamplingParams(max_tokens=64, top_p=0.9, seed=11))
    engine.add_request("aborted", prompts[0], SamplingParams(max_tokens=64, seed=5))
    outputs: list[dict[str, Any]] = []
    step = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs.append(
                    {
                        "id": output.request_id,
                        "prompt_logprobs": repr(output.prompt_logprobs),
                        "completions": [
                            {
                                "text": c.text,
                                "tokens": c.token_ids,
                                "logprobs": repr(c.logprobs),
                                "finish": [c.finish_reason, c.stop_reason],
                            }
                            for c in output.outputs
                        ],
                    }
                )
        step += 1
        if step == 3:
            engine.abort("aborted")
    vectors = llm.embed(["kiln compiles models", "a second text to embed"])
    record = {
        "steps": steps,
        "outputs": outputs,
        "embeddings": [digest(np.asarray(vector, np.float32)) for vector in vectors],
        "stats": repr(engine.stats),
        "num_blocks": engine.num_blocks,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    llm.close()
    print(f"{args.out}: {len(steps)} steps, {len(outputs)} requests")


if __name__ == "__main__":
    main()
