"""The agreement figures the README and docs quote for lossy options, reproducible on any machine:

    .venv/bin/python bench/agreement.py kv-cache MODEL [--kv-cache-dtype fp8] [-n 64] [--backend B]
        teacher-forced: MODEL's greedy tokens after PROMPT with a float32 KV cache, then one step over
        the prompt and those tokens with the other cache; at how many of the n positions its greedy
        token is the float32 cache's, the largest logit error (of the largest logit), and the first
        position they part at with the float32 cache's top-2 margin there
    .venv/bin/python bench/agreement.py activation-bits MODEL [-n 32]
        `--activation-bits 8` against transformers float32 loading the same GGUF, on the continuations
        of tests/backends/tvm/test_qwen2_5_coder.py (its 3 prompts, raw and chat-templated): which
        leave transformers' greedy tokens, and at which token
    .venv/bin/python bench/agreement.py activation-bits-error [MODEL]
        `--activation-bits 8` moves the logits further from the reference backend's on the same program
        (MODEL's GGUF blocks, O2, float32 KV cache; default SmolLM2-135M Q4_1) than the 16-bit kernels'
        1e-3, and stays within 8e-2 (llama.cpp's rounding; SmolLM2 measured 4.5e-2): asserted (exit 1),
        the check tests/backends/tvm/test_cpu.py made before its compile of its own left the suite
    .venv/bin/python bench/agreement.py transformers MODEL [--chat-only] [-n 32]
        asserts that MODEL on the default path (TVM for this CPU, a GGUF's own blocks) gives
        transformers float32's greedy tokens (loading the same GGUF) on those 3 prompts, raw and
        chat-templated (--chat-only: chat-templated): tests/backends/tvm/test_qwen2_5_coder.py's check,
        run here for Qwen2.5-Coder-1.5B-Instruct (a 2-minute compile, too long for the suite); exits 1
        naming each continuation that differs

MODEL: a known name (`kiln pull`), a GGUF or a HF folder; compiled into the compile cache as `kiln.LLM`
does (a first run compiles). Timing is not measured here: prefill speed with each cache is
`bench/artifact_bench.py DIR` on `kiln compile MODEL --kv-cache-dtype ... -o DIR` folders.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

import kiln
from kiln.backends.base import allocate_kv_cache
from kiln.ir.step import SequenceSlice, build_step_inputs

PROMPT = "The three primary colours are"
CONTINUATION_PROMPTS = [  # tests/backends/tvm/test_qwen2_5_coder.py's
    "def quicksort(items):\n    ",
    "The three primary colours are",
    "Write a haiku about a kiln.",
]
BLOCK_SIZE = 16


def _prompt_ids(llm: Any, prompt: str, chat: bool) -> list[int]:
    tokenizer = llm.get_tokenizer()
    if not chat:
        return tokenizer.encode(prompt)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _all_logits(llm: Any, token_ids: list[int]) -> np.ndarray:
    """One step over `token_ids` on a fresh cache: a logits row for every position."""
    executable = llm.artifact.executable
    blocks = -(-len(token_ids) // BLOCK_SIZE)
    cache = allocate_kv_cache(executable, blocks + 1, BLOCK_SIZE)
    piece = SequenceSlice(token_ids, 0, list(range(1, blocks + 1)), logits_at=range(len(token_ids)))
    return np.asarray(executable.step(build_step_inputs([piece], BLOCK_SIZE), cache))


def kv_cache(model: str, dtype: str, num_tokens: int, backend: str) -> None:
    reference = kiln.LLM(model, backend=backend, kv_cache_dtype="f32", show_progress=False, max_model_len=512)
    prompt = _prompt_ids(reference, PROMPT, chat=False)
    params = kiln.SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    greedy = reference.generate([prompt], params)[0].outputs[0].token_ids
    forced = prompt + list(greedy)
    rows = slice(len(prompt) - 1, len(forced) - 1)  # the rows that chose greedy[0..n)
    ours_f32 = _all_logits(reference, forced)[rows]
    del reference
    other = kiln.LLM(model, backend=backend, kv_cache_dtype=dtype, show_progress=False, max_model_len=512)
    ours = _all_logits(other, forced)[rows]
    agree = ours.argmax(-1) == np.asarray(greedy)
    error = float(np.abs(ours - ours_f32).max() / np.abs(ours_f32).max())
    print(f"{model}, backend {backend}: KV cache {dtype} against float32, {PROMPT!r}, {num_tokens} tokens")
    print(f"greedy token agrees at {int(agree.sum())} of {num_tokens} positions; logit error {error:.1%}")
    same = bool((ours_f32.argmax(-1) == greedy).all())
    print(f"the float32 cache's step gives its own greedy tokens: {same}")
    for position in np.flatnonzero(~agree):
        top2 = np.sort(ours_f32[position])[-2:]
        print(f"  parts at token {position}: the float32 cache's top-2 margin there {top2[1] - top2[0]:.4f}")


def activation_bits(model: str, num_tokens: int) -> None:
    import torch
    import transformers

    from kiln.frontend.pull import resolve_model

    ours = kiln.LLM(model, activation_bits=8, show_progress=False, max_model_len=512, max_num_seqs=6)
    path = resolve_model(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    eos = ours.get_tokenizer().eos_token_ids
    cases = [(prompt, chat) for prompt in CONTINUATION_PROMPTS for chat in (False, True)]
    prompts = [_prompt_ids(ours, prompt, chat) for prompt, chat in cases]
    params = kiln.SamplingParams(temperature=0, max_tokens=num_tokens)
    outputs = [o.outputs[0].token_ids for o in ours.generate(prompts, params)]
    parted = 0
    print(f"{model}, --activation-bits 8 against transformers float32, {num_tokens} greedy tokens")
    for (prompt, chat), prompt_ids, tokens in zip(cases, prompts, outputs, strict=True):
        with torch.no_grad():
            generated = hf.generate(
                torch.tensor([prompt_ids]), max_new_tokens=num_tokens, do_sample=False, eos_token_id=list(eos)
            )[0, len(prompt_ids) :].tolist()
        first = next((i for i, (a, b) in enumerate(zip(tokens, generated, strict=False)) if a != b), None)
        if first is None and len(tokens) != len(generated):
            first = min(len(tokens), len(generated))
        parted += first is not None
        where = "same tokens" if first is None else f"parts at token {first}"
        print(f"  {'chat' if chat else 'raw '} {prompt[:30]!r}: {where}")
    print(f"{parted} of {len(cases)} continuations leave transformers' greedy tokens")


QUANTIZED_TOLERANCE = 1e-3  # tests/backends/tvm/test_cpu.py's: 16-bit activations into integer dots
EIGHT_BIT_TOLERANCE = 8e-2  # --activation-bits 8 (llama.cpp's rounding): SmolLM2 Q4_1 measured 4.5e-2


def activation_bits_error(model: str) -> None:
    import tempfile
    from pathlib import Path

    from kiln.backends.base import CompileSettings
    from kiln.backends.targets import Target
    from kiln.backends.tvm.backend import TVMBackend
    from kiln.backends.tvm.cpu_features import host_flags
    from kiln.compiler.build import PipelineOptions, build_reference
    from kiln.frontend.pull import resolve_model

    if "avx2" not in host_flags():
        raise SystemExit("this CPU lacks AVX2: its quantized linears are the float32 kernels (no 8-bit path)")
    built = build_reference(str(resolve_model(model)), PipelineOptions(opt_level=2, quantization="gguf"))
    with tempfile.TemporaryDirectory() as folder:
        backend = TVMBackend()
        backend.compile(built.program, Target("cpu"), Path(folder), CompileSettings(activation_bits=8))
        tvm = backend.load(Path(folder), built.program.weights, Target("cpu"))
        prompt = built.tokenizer.encode("A kiln fires clay at a high temperature")
        inputs = build_step_inputs([SequenceSlice(prompt, 0, [1, 3])], BLOCK_SIZE)
        ours = np.asarray(tvm.step(inputs, tvm.kv_cache_spec.allocate(4, BLOCK_SIZE)), np.float32)
    reference = built.executable
    theirs = np.asarray(reference.step(inputs, reference.kv_cache_spec.allocate(4, BLOCK_SIZE)), np.float32)
    error = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    print(f"{model}, --activation-bits 8 against the reference backend: logit error {error:.2e}")
    if not QUANTIZED_TOLERANCE < error < EIGHT_BIT_TOLERANCE:  # above: the option took effect
        raise SystemExit(f"the error {error:.2e} is outside ({QUANTIZED_TOLERANCE}, {EIGHT_BIT_TOLERANCE})")


def _hf_greedy(hf: Any, prompt_ids: list[int], num_tokens: int, eos: tuple[int, ...]) -> list[int]:
    """transformers' greedy continuation (tests/conftest.py's `hf_greedy`)."""
    import torch

    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
            max_new_tokens=num_tokens,
            do_sample=False,
            eos_token_id=list(eos),
            pad_token_id=eos[0],
        )
    return out[0, len(prompt_ids) :].tolist()


def transformers_greedy(model: str, num_tokens: int, chat_only: bool) -> None:
    import torch
    import transformers

    from kiln.frontend.pull import resolve_model
    from kiln.llm import describe

    ours = kiln.LLM(model, max_num_seqs=6, max_model_len=512, show_progress=False)
    path = resolve_model(model)
    described = describe(ours.artifact)
    print(f"{model}: {described}")
    failures = []
    if not described.startswith("backend tvm, target cpu") or "quantization gguf" not in described:
        failures.append(f"the default path is not TVM with the GGUF's blocks: {described}")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    eos = ours.get_tokenizer().eos_token_ids
    cases = [(p, chat) for p in CONTINUATION_PROMPTS for chat in ((True,) if chat_only else (False, True))]
    prompts = [_prompt_ids(ours, prompt, chat) for prompt, chat in cases]
    params = kiln.SamplingParams(temperature=0, max_tokens=num_tokens)
    outputs = [o.outputs[0].token_ids for o in ours.generate(prompts, params)]
    for (prompt, chat), prompt_ids, tokens in zip(cases, prompts, outputs, strict=True):
        expected = _hf_greedy(hf, prompt_ids, num_tokens, eos)
        whole = len(tokens) == num_tokens or tokens[-1] in eos
        same = tokens == expected and whole
        print(f"  {'chat' if chat else 'raw '} {prompt[:30]!r}: {'same tokens' if same else 'DIFFERENT'}")
        if not same:
            failures.append(f"{(prompt, chat)}: kiln {tokens}, transformers {expected}")
    if failures:
        raise SystemExit("\n".join(failures))
    print(f"{len(cases)} continuations of {num_tokens} greedy tokens equal transformers float32's")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    cache = commands.add_parser("kv-cache")
    cache.add_argument("model")
    cache.add_argument("--kv-cache-dtype", default="fp8")
    cache.add_argument("-n", "--num-tokens", type=int, default=64)
    cache.add_argument("--backend", default="auto")
    bits = commands.add_parser("activation-bits")
    bits.add_argument("model")
    bits.add_argument("-n", "--num-tokens", type=int, default=32)
    bits_error = commands.add_parser("activation-bits-error")
    bits_error.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    greedy = commands.add_parser("transformers")
    greedy.add_argument("model")
    greedy.add_argument("-n", "--num-tokens", type=int, default=32)
    greedy.add_argument("--chat-only", action="store_true", help="chat-templated prompts only")
    args = parser.parse_args()
    if args.command == "kv-cache":
        kv_cache(args.model, args.kv_cache_dtype, args.num_tokens, args.backend)
    elif args.command == "activation-bits-error":
        activation_bits_error(args.model)
    elif args.command == "transformers":
        transformers_greedy(args.model, args.num_tokens, args.chat_only)
    else:
        activation_bits(args.model, args.num_tokens)


if __name__ == "__main__":
    main()
