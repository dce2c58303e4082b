"""Pre-quantized HF checkpoints made by compressed-tensors (llm-compressor's format library) from a tiny
random transformers model: the library attaches the scheme, its own `calculate_qparams` gives the scales
from each weight's range (what llm-compressor's min-max observer computes), and its `ModelCompressor`
packs and saves. Beside each, the float model holding the values the library's `fake_quantize` defines
for those weights: the checkpoint's meaning, as a transformers model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers

from tests.backends.conftest import save_tiny_hf

# name: (compressed-tensors preset, format, the weights' changes to the preset)
SCHEMES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "fp8_dynamic": ("FP8_DYNAMIC", "float-quantized", {}),  # channel scales, dynamic per-token activations
    "fp8_tensor": ("FP8", "float-quantized", {}),  # one scale a tensor, static activations
    "fp8_block": ("FP8_BLOCK", "float-quantized", {"block_structure": [32, 32]}),
    "w4a16": ("W4A16", "pack-quantized", {"group_size": 32}),
    "w4a16_asym": ("W4A16_ASYM", "pack-quantized", {"group_size": 32}),
    "w8a16": ("W8A16", "pack-quantized", {"group_size": 32}),
    "w4a16_channel": ("W4A16", "pack-quantized", {"strategy": "channel", "group_size": None}),
    "w8a8_int": ("W8A8", "int-quantized", {}),
}


def save_compressed(kind: str, scheme: str, folder: Path) -> torch.nn.Module:
    """A tiny `kind` model quantized by `scheme` (SCHEMES) saved at `folder`; returns the float model
    whose linears hold the dequantized weights."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    preset, layout, changes = SCHEMES[scheme]
    float_folder = folder.with_name(folder.name + "-float")
    model = save_tiny_hf(kind, float_folder)
    quantization = preset_name_to_scheme(preset, ["Linear"])
    assert quantization.weights is not None
    for key, value in changes.items():
        setattr(quantization.weights, key, value)
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": quantization}, ignore=["lm_head"])
    )
    reference = save_tiny_hf(kind, float_folder)  # the same seed: the same weights
    with torch.no_grad():
        for name, module in model.named_modules():
            scheme_of = getattr(module, "quantization_scheme", None)
            if scheme_of is None or scheme_of.weights is None:
                continue
            _observe(module, scheme_of.weights)
            args = scheme_of.weights
            zero = getattr(module, "weight_zero_point", None)
            dequantized = fake_quantize(module.weight, module.weight_scale, zero, args)
            reference.get_submodule(name).weight.copy_(dequantized)
            if hasattr(module, "input_scale"):  # a static activation scale: the inputs' range, roughly
                module.input_scale.fill_(float(module.weight.abs().max()) / 448.0)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=layout)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    for file in float_folder.glob("tokenizer*"):
        (folder / file.name).write_bytes(file.read_bytes())
    return reference


def _observe(module: torch.nn.Module, args: Any) -> None:
    """The weight's scales (and zero points) from its range, by compressed-tensors' calculate_qparams."""
    from compressed_tensors.quantization.utils import calculate_qparams

    weight = module.weight
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == "tensor":
        low, high = weight.amin().reshape(1), weight.amax().reshape(1)
    elif strategy == "channel":
        low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    elif strategy == "group":
        grouped = weight.reshape(weight.shape[0], -1, args.group_size)
        low, high = grouped.amin(2), grouped.amax(2)
    else:  # block
        rows, columns = args.block_structure
        blocks = weight.reshape(weight.shape[0] // rows, rows, weight.shape[1] // columns, columns)
        low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
    scale, zero = calculate_qparams(low, high, args)
    module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))


def quantization_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def transformers_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def transformers_checkpoint(folder: Path) -> torch.nn.Module:
    """The checkpoint as transformers (with compressed-tensors) loads and runs it, decompressed, with its
    input activations left in float, as Kiln computes them (and vLLM does on GPUs without FP8, running
    an FP8 checkpoint's weights alone)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None:
            module.quantization_scheme = scheme.model_copy(update={"input_activations": None})
    with torch.no_grad():
        model(torch.tensor([[1]]))  # the first forward decompresses the weights
    return model
