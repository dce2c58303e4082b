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


# -- GPTQ and AWQ, made by auto-gptq's and AutoAWQ's own code ---------------------------------------------

CALIBRATION_SEED = 7


def quantizer_sources() -> Path:
    """Where scripts/quantizer_sources.sh unpacked auto-gptq and AutoAWQ (`make test` runs it)."""
    import os

    home = Path(os.environ.get("KILN_HOME", "~/.cache/kiln")).expanduser()
    folder = home / "quantizer-sources"
    if not (folder / "autoawq-0.2.9" / "awq").is_dir() or not (folder / "auto_gptq-0.7.1").is_dir():
        import pytest

        pytest.skip(f"no auto-gptq / AutoAWQ source under {folder}: run `bash scripts/quantizer_sources.sh`")
    return folder


def _source_package(name: str, root: Path) -> None:
    """Import `name`'s submodules from `root` without its __init__ (which imports what the tests do not
    need: CUDA extensions, datasets, every model family)."""
    import sys
    import types

    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [str(root / name)]
        sys.modules[name] = package


def _auto_gptq() -> tuple[Any, Any]:
    """(auto-gptq's GPTQ quantizer class, its QuantLinear with the torch dequantizing forward)."""
    import importlib
    import sys
    import types

    root = quantizer_sources() / "auto_gptq-0.7.1"
    _source_package("auto_gptq", root)
    for sub in ("nn_modules", "nn_modules.qlinear"):
        if f"auto_gptq.{sub}" not in sys.modules:
            module = types.ModuleType(f"auto_gptq.{sub}")
            module.__path__ = [str(root / "auto_gptq" / sub.replace(".", "/"))]
            sys.modules[module.__name__] = module
    gptq = importlib.import_module("auto_gptq.quantization.gptq")
    qlinear = importlib.import_module("auto_gptq.nn_modules.qlinear.qlinear_cuda")
    return gptq.GPTQ, qlinear.QuantLinear


def _autoawq() -> tuple[Any, Any, Any]:
    """(AutoAWQ's pseudo_quantize_tensor, WQLinear_GEMM, dequantize_gemm)."""
    import importlib
    import sys
    import types

    _source_package("awq", quantizer_sources() / "autoawq-0.2.9")
    calibration = types.ModuleType("awq.utils.calib_data")  # needs `datasets`; calibration is not used
    calibration.get_calib_dataset = None  # type: ignore[attr-defined]
    sys.modules.setdefault(calibration.__name__, calibration)
    quantizer = importlib.import_module("awq.quantize.quantizer")
    gemm = importlib.import_module("awq.modules.linear.gemm")
    packing = importlib.import_module("awq.utils.packing_utils")
    return quantizer.AwqQuantizer.pseudo_quantize_tensor, gemm.WQLinear_GEMM, packing.dequantize_gemm


def _quantized_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """The decoder layers' linears (the LM head stays float, as both tools leave it by default)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}"
    ]


def save_gptq(
    kind: str,
    folder: Path,
    *,
    bits: int = 4,
    group_size: int = 32,
    desc_act: bool = False,
    sym: bool = True,
    checkpoint_format: str = "gptq",
) -> torch.nn.Module:
    """A tiny `kind` model quantized by auto-gptq's GPTQ (random calibration inputs, float16 as the tool
    runs it) and packed by its QuantLinear, saved at `folder` as auto-gptq saves it; returns the float
    model whose linears hold the weights QuantLinear's own forward computes from the packed tensors (its
    torch path, scales in float32). `checkpoint_format="gptq_v2"` stores the zero points as gptqmodel's
    v2 does (not minus one)."""
    import torch.cuda

    gptq_class, quant_linear = _auto_gptq()
    torch.cuda.synchronize = lambda *args, **kwargs: None  # fasterquant times itself on a GPU
    float_folder = folder.with_name(folder.name + "-float")
    model = _float16_valued(save_tiny_hf(kind, float_folder))
    state = dict(model.state_dict())
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    with torch.no_grad():
        for name, linear in _quantized_linears(model):
            half = torch.nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
            half.load_state_dict(linear.state_dict())
            half = half.half()
            quantizer = gptq_class(half)
            quantizer.quantizer.configure(bits, perchannel=True, sym=sym, mse=False)
            calibration = torch.randn(4, 16, linear.in_features, generator=generator).half()
            quantizer.add_batch(calibration, None)
            scale, zero, g_idx = quantizer.fasterquant(
                blocksize=32, percdamp=0.01, group_size=group_size, actorder=desc_act, static_groups=False
            )
            packed = quant_linear(
                bits,
                group_size,
                linear.in_features,
                linear.out_features,
                linear.bias is not None,
                weight_dtype=torch.float16,
            )
            packed.pack(half, scale, zero, g_idx)
            for part in ("qweight", "qzeros", "scales", "g_idx", "bias"):
                if getattr(packed, part, None) is not None:
                    state[f"{name}.{part}"] = getattr(packed, part).clone()
            state.pop(f"{name}.weight")
            if checkpoint_format == "gptq_v2":
                state[f"{name}.qzeros"] = _plus_one(packed.qzeros, bits)
            packed.scales = packed.scales.float()
            linear.weight.copy_(packed(torch.eye(linear.in_features)).t() - _bias_of(packed))
            if linear.bias is not None:
                linear.bias.copy_(packed.bias.float())
    config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": checkpoint_format,
        "damp_percent": 0.01,
        "true_sequential": True,
    }
    _save_packed(float_folder, folder, state, config)
    return model


def _float16_valued(model: torch.nn.Module) -> torch.nn.Module:
    """The model's values rounded to float16, as the tools save what they leave float."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.half().float())
    return model


def _bias_of(packed: torch.nn.Module) -> torch.Tensor:
    bias = getattr(packed, "bias", None)
    return torch.zeros(()) if bias is None else bias.float().reshape(-1, 1)


def _plus_one(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """Each packed zero point plus one (v1's stored value → v2's), word by word."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    values = ((qzeros.unsqueeze(-1) >> shifts) & mask) + 1
    assert int(values.max()) <= mask, "a zero point past the bits: v2 cannot hold it"
    return (values.to(torch.int64) << shifts.to(torch.int64)).sum(-1).to(torch.uint32).view(torch.int32)


def save_awq(kind: str, folder: Path, *, group_size: int = 32) -> torch.nn.Module:
    """A tiny `kind` model quantized by AutoAWQ's own zero-point quantizer (its pseudo_quantize_tensor,
    4 bits) and packed by its WQLinear_GEMM, saved at `folder` as AutoAWQ saves it (version gemm); returns
    the float model whose linears hold what AutoAWQ's dequantize_gemm computes from the packed tensors
    (scales in float32)."""
    import types

    pseudo_quantize, wq_linear, dequantize_gemm = _autoawq()
    settings = types.SimpleNamespace(group_size=group_size, zero_point=True, w_bit=4)
    float_folder = folder.with_name(folder.name + "-float")
    model = _float16_valued(save_tiny_hf(kind, float_folder))
    state = dict(model.state_dict())
    with torch.no_grad():
        for name, linear in _quantized_linears(model):
            half = torch.nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
            half.load_state_dict(linear.state_dict())
            half = half.half()
            values, scales, zeros = pseudo_quantize(settings, half.weight.data)
            half.weight.data = values
            packed = wq_linear.from_linear(
                half, 4, group_size, scales=scales.t().contiguous(), zeros=zeros.t().contiguous()
            )
            for part in ("qweight", "qzeros", "scales", "bias"):
                if getattr(packed, part, None) is not None:
                    state[f"{name}.{part}"] = getattr(packed, part).clone()
            state.pop(f"{name}.weight")
            weight = dequantize_gemm(packed.qweight, packed.qzeros, packed.scales.float(), 4, group_size)
            linear.weight.copy_(weight.t())
            if linear.bias is not None:
                linear.bias.copy_(packed.bias.float())
    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    _save_packed(float_folder, folder, state, config)
    return model


def _save_packed(
    float_folder: Path, folder: Path, state: dict[str, torch.Tensor], quantization: dict[str, Any]
) -> None:
    """The packed state written as the tools write it: one safetensors file, float tensors in float16,
    config.json with the quantization_config, the tokenizer beside."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: (tensor.half() if tensor.is_floating_point() else tensor).contiguous()
        for name, tensor in state.items()
    }
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((float_folder / "config.json").read_text())
    config["quantization_config"] = quantization
    config["torch_dtype"] = "float16"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for file in float_folder.glob("tokenizer*"):
        (folder / file.name).write_bytes(file.read_bytes())
