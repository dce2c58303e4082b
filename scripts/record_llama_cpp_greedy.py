"""Record llama.cpp's greedy continuations of raw prompts as a test fixture (JSON).

Run against a llama-server built by `make bench-peers` on the same GGUF, e.g.:

    .venv-peers/llama.cpp/bin/llama-server -m MODEL.gguf -t 2 -c 2048 --port 8088 &
    .venv/bin/python scripts/record_llama_cpp_greedy.py --port 8088 --model-name gemma-3-270m \
        -o tests/fixtures/gemma3_270m_llama_cpp.json "The capital of France is" ...

Each prompt gets llama.cpp's tokenization (`/tokenize`, with BOS) and `n_predict` greedy tokens (top-k 1)
with the two most likely tokens' log-probabilities at each position, so a test can stop at the first
near-tie.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path
from typing import Any


def _post(port: int, route: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{route}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


def record(port: int, prompt: str, n_predict: int) -> dict[str, Any]:
    prompt_tokens = _post(port, "/tokenize", {"content": prompt, "add_special": True})["tokens"]
    body = {"prompt": prompt, "n_predict": n_predict, "top_k": 1, "temperature": 0, "n_probs": 2}
    completion = _post(port, "/completion", body | {"return_tokens": True, "cache_prompt": False})
    steps = completion["completion_probabilities"]
    return {
        "prompt": prompt,
        "prompt_tokens": prompt_tokens,
        "tokens": [step["id"] for step in steps],
        "top2_logprobs": [[choice["logprob"] for choice in step["top_logprobs"][:2]] for step in steps],
        "text": completion["content"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", nargs="+")
    parser.add_argument("--port", type=int, default=8088)
    parser.add_argument("--n-predict", type=int, default=32)
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--command", default="", help="the llama-server command line, recorded as is")
    parser.add_argument("--tokenize", action="append", default=[], help="also record this text's tokens")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    fixture = {
        "model": args.model_name,
        "made_by": args.command,
        "prompts": [record(args.port, prompt, args.n_predict) for prompt in args.prompts],
        "tokenized": [
            {
                "text": text,
                "tokens": _post(args.port, "/tokenize", {"content": text, "add_special": True})["tokens"],
            }
            for text in args.tokenize
        ],
    }
    args.output.write_text(json.dumps(fixture, indent=1) + "\n")


if __name__ == "__main__":
    main()
