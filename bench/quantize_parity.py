"""`kiln compile HF_DIR --quantization q4_k_m` (and the other llama.cpp mixes) against llama-quantize itself:

    .venv/bin/python bench/quantize_parity.py [--mixes q4_k_m,q5_k_m,q6_k,q8_0,q4_0] [--llama-quantize PATH]
        [--work DIR] [--compile]

For each of three tiny random checkpoints made by transformers in bf16 (a 12-layer Llama with an LM head
of its own, a 9-layer Llama with tied embeddings and rows of 320 values, a 4-layer Mixtral with 8
experts), llama.cpp's converter writes an F32 GGUF and `llama-quantize` (`make bench-peers` builds it)
quantizes it to each mix. The table: whether every quantized tensor's type is the one kiln chooses, and
how many tensors' blocks differ from the blocks kiln makes of the HF folder (after llama.cpp's Q/K row
permutation is undone). --compile also compiles the 12-layer folder with --quantization q4_k_m and
llama-quantize's file for this CPU and says whether the weights files and compiled code are identical.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from kiln.compiler.build import build_program, mix_model
from kiln.frontend.load import load_model
from kiln.frontend.pull import kiln_home
from kiln.frontend.source import QuantizedTensor
from kiln.passes.quantize.gguf_mix import MIXES, encoded_blocks

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.backends.reference.test_llama_cpp_converted import save_byte_level_tokenizer  # noqa: E402

COMMON = dict(vocab_size=320, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CHECKPOINTS = {
    "llama-12": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(hidden_size=256, intermediate_size=768, num_hidden_layers=12),
    ),
    "llama-9-tied-320": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(hidden_size=320, intermediate_size=640, num_hidden_layers=9, tie_word_embeddings=True),
    ),
    "mixtral-4x8": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
    ),
}


def make_checkpoint(name: str, folder: Path) -> None:
    if (folder / "config.json").is_file():
        return
    config_cls, model_cls, sizes = CHECKPOINTS[name]
    torch.manual_seed(len(name))
    model = model_cls(config_cls(**COMMON, **{"tie_word_embeddings": False, **sizes}))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(folder)
    save_byte_level_tokenizer(folder)


def run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[:3])} ... failed:\n{result.stderr[-3000:]}")


def converted(folder: Path, source: Path) -> Path:
    out = folder.with_name(folder.name + "-f32.gguf")
    if not out.is_file():
        wrapper = REPO / "scripts" / "llama_cpp_convert.py"
        run(
            [
                sys.executable,
                str(wrapper),
                str(source),
                "gpt-2",
                str(folder),
                "--outfile",
                str(out),
                "--outtype",
                "f32",
            ]
        )
    return out


def compare(folder: Path, quantized: dict[str, Path]) -> list[tuple[str, bool, int, int]]:
    built = build_program(str(folder))
    rows = []
    for mix, path in quantized.items():
        theirs = {n: w for n, w in load_model(str(path)).weights.items() if isinstance(w, QuantizedTensor)}
        ours = encoded_blocks(built.captured, mix, mix_model(built.config))
        same_types = {n: b.ggml_type for n, b in ours.items()} == {n: b.ggml_type for n, b in theirs.items()}
        differing = sum(not np.array_equal(ours[n].read(), theirs[n].read()) for n in theirs if n in ours)
        rows.append((mix, same_types, len(theirs), differing))
    return rows


def compiled_the_same(folder: Path, gguf_path: Path, work: Path) -> str:
    outputs = []
    for model, extra in ((folder, ["--quantization", "q4_k_m"]), (gguf_path, [])):
        out = work / f"artifact-{len(outputs)}"
        run(
            [
                str(REPO / ".venv" / "bin" / "kiln"),
                "compile",
                str(model),
                "--target",
                "cpu",
                "-o",
                str(out),
                "--force",
                *extra,
            ]
        )
        outputs.append(out)
    manifests = [json.loads((out / "manifest.json").read_text()) for out in outputs]
    weights = [{k: v for k, v in m["files"].items() if k.startswith("weights/")} for m in manifests]
    code = [(out / "cpu" / "step.so").read_bytes() for out in outputs]
    return (
        f"weights files identical: {weights[0] == weights[1]}; compiled code identical: {code[0] == code[1]}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mixes", default=",".join(MIXES))
    parser.add_argument(
        "--llama-quantize", type=Path, default=REPO / ".venv-peers" / "llama.cpp" / "bin" / "llama-quantize"
    )
    parser.add_argument("--work", type=Path, default=kiln_home() / "bench" / "quantize_parity")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    if not args.llama_quantize.is_file():
        raise SystemExit(f"no {args.llama_quantize}: `make bench-peers` builds llama.cpp")
    sources = sorted((kiln_home() / "llama.cpp-source").glob("*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not sources:
        raise SystemExit("no llama.cpp source: run `bash scripts/llama_cpp_source.sh '' --python-only`")
    args.work.mkdir(parents=True, exist_ok=True)
    print(
        "| checkpoint | mix | types as llama-quantize's | quantized tensors | tensors with differing blocks |"
    )
    print("|---|---|---|---|---|")
    for name in CHECKPOINTS:
        folder = args.work / name
        make_checkpoint(name, folder)
        f32 = converted(folder, sources[-1].parent)
        quantized = {}
        for mix in args.mixes.split(","):
            out = args.work / f"{name}-{mix}.gguf"
            if not out.is_file():
                run([str(args.llama_quantize), str(f32), str(out), mix.upper()])
            quantized[mix] = out
        for mix, same_types, count, differing in compare(folder, quantized):
            print(f"| {name} | {mix} | {'yes' if same_types else 'NO'} | {count} | {differing} |")
    if args.compile:
        start = time.perf_counter()
        folder = args.work / "llama-12"
        verdict = compiled_the_same(folder, args.work / "llama-12-q4_k_m.gguf", args.work)
        print(
            f"\nkiln compile --target cpu, llama-12, HF folder --quantization q4_k_m vs llama-quantize's: "
            f"{verdict} ({time.perf_counter() - start:.0f} s)"
        )


if __name__ == "__main__":
    main()
