"""Random LoRA adapters for a model, as PEFT writes them, and llama.cpp's GGUF of each (its own converter).

    python scripts/make_lora.py MODEL OUT [--rank 16] [--count 1] [--seed 0] [--gguf LLAMA_CPP_SOURCE]

MODEL: a HF directory or a GGUF file (transformers reads its config). Writes OUT/lora-<i>/ (PEFT's
adapter_config.json + adapter_model.safetensors, random A and B on q/k/v/o and the MLP projections of
every layer, lora_alpha = 2 * rank) and, with --gguf, OUT/lora-<i>.gguf by llama.cpp's
convert_lora_to_gguf.py (float32). The base weights are never loaded: the model is built on the meta
device, only the adapters' tensors are made.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import peft
import torch
import transformers

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_config(model: Path) -> transformers.PretrainedConfig:
    if model.suffix == ".gguf":
        config = transformers.AutoConfig.from_pretrained(model.parent, gguf_file=model.name)
    else:
        config = transformers.AutoConfig.from_pretrained(model)
    if not config.architectures:  # a GGUF's config names none; llama.cpp's converter needs it
        config.architectures = [transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__]
    return config


def make_adapter(config: transformers.PretrainedConfig, out: Path, rank: int, seed: int) -> Path:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    adapted = peft.get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    for name, module in adapted.named_modules():
        if isinstance(module, torch.nn.Linear) and (".lora_A." in name + "." or ".lora_B." in name + "."):
            rows, fan_in = module.weight.shape  # A ~ U(+-1/sqrt(in)) as PEFT's init; B small, the model sane
            bound = 1 / fan_in**0.5 if ".lora_A." in name + "." else 0.02
            values = (torch.rand((rows, fan_in), generator=generator) * 2 - 1) * bound
            module.weight = torch.nn.Parameter(values)
    adapted.save_pretrained(out)
    return out


def to_gguf(source: Path, config: transformers.PretrainedConfig, adapter: Path, out: Path) -> Path:
    base = adapter.parent / "base-config"
    config.save_pretrained(base)  # what the converter reads of the base model
    command = [sys.executable, str(source / "convert_lora_to_gguf.py"), "--base", str(base)]
    command += ["--outtype", "f32", "--outfile", str(out), str(adapter)]
    env = {**os.environ, "PYTHONPATH": f"{source}:{source / 'gguf-py'}"}
    subprocess.run(command, check=True, env=env, capture_output=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--gguf", type=Path, default=None, help="llama.cpp's source (convert_lora_to_gguf.py)"
    )
    args = parser.parse_args()
    config = hf_config(args.model)
    for index in range(args.count):
        adapter = make_adapter(config, args.out / f"lora-{index}", args.rank, args.seed + index)
        print(adapter)
        if args.gguf is not None:
            print(to_gguf(args.gguf, config, adapter, args.out / f"lora-{index}.gguf"))


if __name__ == "__main__":
    main()
