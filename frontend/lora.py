"""LoRA adapter files → AdapterWeights (ir/adapters.py): PEFT folders (adapter_config.json +
adapter_model.safetensors) and llama.cpp's LoRA GGUFs (convert_lora_to_gguf.py), with the scale PEFT
defines (lora_alpha / r, rsLoRA lora_alpha / sqrt(r), per-module rank_pattern / alpha_pattern) or
llama.cpp's (adapter.lora.alpha / rank; 1 without an alpha) folded into b."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import ModelLoadError
from kiln.frontend.gguf_loader import _LAYER_TENSORS, _unpermuted_order, field_value, open_gguf
from kiln.ir.adapters import AdapterBase, AdapterWeights, Matrix

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PEFT_KEY = re.compile(
    r"^(?P<path>.*\.layers\.(?P<layer>\d+)\.(?:\w+\.)*?(?P<module>\w+))\.lora_(?P<ab>[AB])\.weight$"
)
_GGUF_KEY = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<part>\w+)\.weight\.lora_(?P<ab>[ab])$")
_GGUF_FUSED = {"phi3": {"attn_qkv": "qkv_proj", "ffn_up": "gate_up_proj"}}
_ADAPTED_GGUF_PARTS = {part: hf.split(".")[-1] for part, hf in _LAYER_TENSORS.items() if hf.endswith("_proj")}
_HINT = "make it with PEFT's save_pretrained (a folder) or llama.cpp's convert_lora_to_gguf.py (a .gguf file)"


class AdapterError(ModelLoadError):
    """A LoRA adapter that is missing, corrupt, or made for something else."""


def read_adapter(path: str | Path, base: AdapterBase) -> AdapterWeights:
    """The adapter at `path`: a PEFT folder, or a llama.cpp LoRA .gguf."""
    where = Path(path)
    if where.is_dir():
        return _read_peft(where)
    if where.is_file():
        return _read_gguf(where, base)
    raise AdapterError(f"{where}: no such adapter folder or file", hint=_HINT)


def _read_peft(folder: Path) -> AdapterWeights:
    config = _peft_config(folder)
    weights_path = folder / PEFT_WEIGHTS
    if not weights_path.exists():
        found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
        raise AdapterError(f"{folder}: no {PEFT_WEIGHTS} (found {found})", hint=_HINT)
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError, ValueError) as error:
        raise AdapterError(f"{weights_path}: corrupt safetensors file ({error})", hint=_HINT) from None
    pairs: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    paths: dict[tuple[str, int], str] = {}
    for key, tensor in tensors.items():
        match = _PEFT_KEY.match(key)
        if match is None or "vision" in key or "visual" in key:
            raise AdapterError(
                f"{weights_path}: tensor {key} adapts a weight Kiln's adapters do not reach",
                hint="Kiln applies adapters to the decoder layers' q/k/v/o and MLP projections only",
            )
        slot = (match["module"], int(match["layer"]))
        pairs.setdefault(slot, {})[match["ab"]] = tensor
        paths[slot] = match["path"]
    updates = {}
    for slot, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(
                f"{weights_path}: {paths[slot]} has lora_{'AB'[('A' in pair)]} without its pair", hint=_HINT
            )
        a, b = pair["A"].astype(np.float32), pair["B"].astype(np.float32)
        rank = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != rank:
            raise AdapterError(
                f"{weights_path}: {paths[slot]} lora_A {a.shape} and lora_B {b.shape} do not fit", hint=_HINT
            )
        alpha = float(_pattern_value(config.get("alpha_pattern"), paths[slot], config["lora_alpha"]))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        updates[slot] = (np.ascontiguousarray(a), np.ascontiguousarray(b * np.float32(scale)))
    if not updates:
        raise AdapterError(f"{weights_path}: holds no LoRA tensors", hint=_HINT)
    return AdapterWeights(str(folder), updates)


def _peft_config(folder: Path) -> dict[str, Any]:
    path = folder / PEFT_CONFIG
    if not path.exists():
        raise AdapterError(f"{folder}: no {PEFT_CONFIG}: not a PEFT adapter folder", hint=_HINT)
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AdapterError(f"{path}: not JSON ({error})", hint=_HINT) from None
    kind = config.get("peft_type", "LORA")
    refusals = {
        "peft_type": (kind != "LORA", f"is {kind}, not LORA"),
        "use_dora": (bool(config.get("use_dora")), "DoRA adapters are not supported"),
        "modules_to_save": (bool(config.get("modules_to_save")), "full copies of modules are not supported"),
        "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), "Conv1D (GPT-2) weights are not supported"),
        "bias": (config.get("bias", "none") != "none", "trained biases are not supported"),
        "lora_alpha": (not isinstance(config.get("lora_alpha"), int | float), "is missing"),
    }
    for field, (refused, why) in refusals.items():
        if refused:
            raise AdapterError(
                f"{path}: {field} {why}", hint="a plain LoRA adapter of the attention and MLP linears"
            )
    return config


def _pattern_value(patterns: dict[str, Any] | None, module_path: str, default: Any) -> Any:
    """PEFT's per-module override: a key that matches the end of the module's path."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module_path):
            return value
    return default


def _read_gguf(path: Path, base: AdapterBase) -> AdapterWeights:
    try:
        reader = open_gguf(path)
    except ModelLoadError as error:
        raise AdapterError(str(error), hint=_HINT) from None
    kind, adapter = field_value(reader, "general.type"), field_value(reader, "adapter.type")
    if kind != "adapter" or adapter != "lora":
        raise AdapterError(f"{path}: a GGUF of general.type {kind!r}, not a LoRA adapter", hint=_HINT)
    arch = str(field_value(reader, "general.architecture"))
    model_arch = (
        base.architecture.removesuffix("ForCausalLM").removesuffix("ForConditionalGeneration").lower()
    )
    if arch.rstrip("0123456789") != model_arch.rstrip("0123456789") and not (arch, model_arch) == (
        "gemma3",
        "gemma3",
    ):
        raise AdapterError(
            f"{path}: a LoRA for architecture {arch}, and this model is {base.architecture}",
            hint="use an adapter made for this base model",
        )
    alpha = float(field_value(reader, "adapter.lora.alpha") or 0.0)
    parts = {**_ADAPTED_GGUF_PARTS, **_GGUF_FUSED.get(arch, {})}
    pairs: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    for tensor in reader.tensors:
        match = _GGUF_KEY.match(tensor.name)
        if match is None or match["part"] not in parts:
            raise AdapterError(
                f"{path}: tensor {tensor.name} adapts a weight Kiln's adapters do not reach",
                hint="Kiln applies adapters to the decoder layers' q/k/v/o and MLP projections only",
            )
        slot = (parts[match["part"]], int(match["layer"]))
        pairs.setdefault(slot, {})[match["ab"]] = _float_matrix(tensor, path)
    updates = {}
    for (module, layer), pair in pairs.items():
        if set(pair) != {"a", "b"}:
            raise AdapterError(f"{path}: {module} of layer {layer} lacks lora_a or lora_b", hint=_HINT)
        a, b = pair["a"], pair["b"]
        rank = a.shape[0]
        if b.shape[1] != rank:
            raise AdapterError(
                f"{path}: {module} of layer {layer}: lora_a {a.shape} and lora_b {b.shape} do not fit",
                hint=_HINT,
            )
        heads = {"q_proj": base.num_attention_heads, "k_proj": base.num_key_value_heads}.get(module)
        if arch == "llama" and heads is not None:
            b = b[_unpermuted_order(b.shape[0], heads)]
        scale = alpha / rank if alpha else 1.0
        updates[(module, layer)] = (np.ascontiguousarray(a), np.ascontiguousarray(b * np.float32(scale)))
    if not updates:
        raise AdapterError(f"{path}: holds no LoRA tensors", hint=_HINT)
    return AdapterWeights(str(path), updates)


def _float_matrix(tensor: Any, path: Path) -> Matrix:
    kind = tensor.tensor_type.name
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    if kind == "F32":
        values = np.array(tensor.data, np.float32)
    elif kind == "F16":
        values = np.array(tensor.data).astype(np.float32)
    elif kind == "BF16":
        values = (np.array(tensor.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        from gguf.quants import dequantize

        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise AdapterError(
                f"{path}: tensor {tensor.name} is {kind}",
                hint="convert with --outtype f32, f16, bf16 or q8_0",
            ) from None
    return values.reshape(shape).astype(np.float32, copy=False)
