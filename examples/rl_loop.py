"""A reinforcement-learning loop against a running Kiln server, weights pushed after every step.

The trainer (this process, torch) holds a tiny random Llama. Each step it samples rollouts from Kiln
(`openai` client, 4 samples a prompt), rewards each by the share of its tokens with an even id, takes a
REINFORCE step (Adam), and pushes the new weights into the server over torch.distributed (gloo) with
`kiln.WeightSync`. After each push it checks that Kiln serves exactly the trainer's weights: Kiln's
greedy tokens equal transformers' on the trainer's current model (float artifacts), or each of Kiln's
greedy tokens is within `--tolerance` nats of transformers' best (int8: its quantized weights).

    python examples/rl_loop.py                                  # starts kiln serve (reference backend)
    python examples/rl_loop.py --backend tvm --quantization int8
    python examples/rl_loop.py --server http://127.0.0.1:8000 --model-dir DIR   # a server of DIR's model

Exit 0 when every check passed; 1 with the step that failed.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
import transformers
from openai import OpenAI
from tokenizers import Tokenizer, models, pre_tokenizers

import kiln

VOCAB = 64
PROMPTS = [[1, 5, 9, 13], [2, 7, 11], [3, 4, 6, 8, 10]]
ROLLOUT_TOKENS = 8
CHECK_TOKENS = 8


def make_model(folder: Path, seed: int = 0) -> transformers.LlamaForCausalLM:
    """A tiny random Llama with a word-level tokenizer (t1 .. t63), saved at `folder`."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=0,
        bos_token_id=0,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, **{f"t{i}": i for i in range(1, VOCAB)}}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(
        folder
    )
    return model


def start_server(
    folder: Path, backend: str, quantization: str, log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "kiln.cli", "serve", str(folder), "--port", str(port)]
    command += ["--backend", backend, "--quantization", quantization, "--enable-weight-updates"]
    command += ["--served-model-name", "policy", "--uvicorn-log-level", "warning"]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"kiln serve exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"kiln serve did not start:\n{log.read_text()}")


def token_ids(text: str) -> list[int]:
    """The ids of a completion's text (with skip_special_tokens false, <unk> is id 0)."""
    return [0 if word == "<unk>" else int(word[1:]) for word in text.split()]


def reinforce_step(
    model: transformers.LlamaForCausalLM, optimizer: torch.optim.Optimizer, client: OpenAI
) -> float:
    """Rollouts from Kiln, rewards, one policy-gradient step; the mean reward."""
    losses, rewards = [], []
    for prompt in PROMPTS:
        sampled = client.completions.create(
            model="policy",
            prompt=prompt,
            max_tokens=ROLLOUT_TOKENS,
            temperature=1.0,
            n=4,
            seed=len(rewards),
            extra_body={"skip_special_tokens": False},
        )
        completions = [token_ids(choice.text) for choice in sampled.choices]
        scores = [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completions]
        baseline = sum(scores) / len(scores)
        rewards += scores
        for ids, score in zip(completions, scores, strict=True):
            if not ids:
                continue
            sequence = torch.tensor([prompt + ids])
            logprobs = torch.log_softmax(model(sequence).logits[0, len(prompt) - 1 : -1], dim=-1)
            taken = logprobs.gather(1, torch.tensor(ids)[:, None]).sum()
            losses.append(-(score - baseline) * taken)
    optimizer.zero_grad()
    torch.stack(losses).sum().backward()
    optimizer.step()
    return sum(rewards) / len(rewards)


def greedy(model: transformers.LlamaForCausalLM, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' argmax tokens after `prompt`, EOS or not."""
    ids = list(prompt)
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(num_tokens):
            ids.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([ids[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return ids[len(prompt) :]


def check_greedy(model: transformers.LlamaForCausalLM, client: OpenAI, version: int, tolerance: float) -> str:
    """Kiln's greedy tokens against transformers' on the trainer's weights; a problem, or ""."""
    for prompt in PROMPTS:
        raw = client.completions.with_raw_response.create(
            model="policy",
            prompt=prompt,
            max_tokens=CHECK_TOKENS,
            temperature=0.0,
            extra_body={"skip_special_tokens": False},
        )
        served = int(raw.headers["kiln-weight-version"])
        if served != version:
            return f"prompt {prompt}: answered by weight version {served}, pushed {version}"
        choice = raw.parse().choices[0]
        kiln_ids = token_ids(choice.text)
        if choice.finish_reason == "stop":  # ended on EOS, which the text leaves out
            kiln_ids.append(model.config.eos_token_id)
        with torch.no_grad():
            if tolerance == 0.0:
                expected = greedy(model, prompt, len(kiln_ids))
                if kiln_ids != expected:
                    return f"prompt {prompt}: Kiln {kiln_ids}, transformers {expected}"
                continue
            logits = model(torch.tensor([prompt + kiln_ids])).logits[0, len(prompt) - 1 : -1]
            logprobs = torch.log_softmax(logits, dim=-1)
            for position, token in enumerate(kiln_ids):
                gap = float(logprobs[position].max() - logprobs[position, token])
                if gap > tolerance:
                    return (
                        f"prompt {prompt}: token {position} of Kiln's greedy ({token}) is {gap:.4f} nats "
                        f"below transformers' best ({int(logprobs[position].argmax())}); tolerance "
                        f"{tolerance}"
                    )
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--server", help="a running kiln serve --enable-weight-updates of --model-dir's model"
    )
    parser.add_argument("--model-dir", type=Path, help="where the trainer's model is (made if absent)")
    parser.add_argument("--backend", default="reference", help="the server's backend, when this starts it")
    parser.add_argument("--quantization", default="none", help="none or int8, when this starts the server")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument(
        "--tolerance", type=float, default=None, help="nats; default 0 (identical) for float, 0.05 for int8"
    )
    args = parser.parse_args(argv)
    tolerance = (
        args.tolerance if args.tolerance is not None else (0.05 if args.quantization == "int8" else 0.0)
    )
    work = Path(tempfile.mkdtemp(prefix="kiln-rl-"))
    folder = args.model_dir or work / "policy"
    model = (
        transformers.LlamaForCausalLM.from_pretrained(folder).eval()
        if (folder / "config.json").is_file()
        else make_model(folder)
    )
    server, url = (
        (None, args.server)
        if args.server
        else start_server(folder, args.backend, args.quantization, work / "serve.log")
    )
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        sync = kiln.WeightSync(url)
        sync.join()
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        print(f"{'step':>4}  {'reward':>6}  {'version':>7}  {'push s':>6}  check")
        for step in range(1, args.steps + 1):
            reward = reinforce_step(model, optimizer, client)
            started = time.perf_counter()
            version = sync.push(model.named_parameters())
            took = time.perf_counter() - started
            problem = check_greedy(model, client, version, tolerance)
            verdict = problem or "greedy as transformers"
            print(f"{step:>4}  {reward:>6.3f}  {version:>7}  {took:>6.2f}  {verdict}")
            if problem:
                return 1
        return 0
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)


if __name__ == "__main__":
    sys.exit(main())
