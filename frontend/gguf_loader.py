"""Load a llama.cpp GGUF file into a ModelSource: HF config, HF-named weights, tokenizer data.

Nothing is read into memory here: float tensors are deferred (ir/deferred.py) in their stored dtype,
quantized tensors stay in their block layout (`QuantizedTensor`) as views of the mapped file, so that
quantization passes import them without re-quantizing and a compile reads one tensor at a time.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from kiln.errors import ModelLoadError, UnsupportedArchitectureError
from kiln.frontend.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    RopeScaling,
    longrope_attention_factor,
)
from kiln.frontend.gguf_header import QUANTIZED_TYPES
from kiln.frontend.models import adapt_gguf_weights
from kiln.frontend.source import ModelSource, QuantizedTensor, Weight
from kiln.ir.deferred import Deferred
from kiln.ir.mapped import let_go

# GGUF `general.architecture` → HF architecture.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
# llama.cpp renormalises the top-k router weights for these (Mixtral is "llama" with experts)
GGUF_NORMALIZED_ROUTERS = ("llama", "qwen3moe")
# llama.cpp's Gemma 3 conventions its GGUF files do not state: every 6th layer full attention, the
# others sliding with rope base 10,000; attention scale head_dim**-0.5 (all but the 27B)
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM_TENSORS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}  # Qwen3, Gemma 3
# the norms around the MLP: Llama's one, Gemma's four (their weights are 1 + w in the file already)
_NORM_TENSORS = {
    "default": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}


# a mixture-of-experts layer: the router and the stacked experts in place of the MLP
_MOE_TENSORS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_DENSE_MLP = ("ffn_gate", "ffn_up", "ffn_down")


# Phi-3 keeps q/k/v in one tensor and gate/up in another (split after loading: frontend/models/phi3.py)
_FUSED_TENSORS = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
_FUSED_AWAY = ("attn_q", "attn_k", "attn_v", "ffn_gate")


def layer_names(family: str, qk_norm: bool, moe: bool = False) -> dict[str, str]:
    """GGUF layer tensor part → HF module path, for a family (`moe`: a mixture-of-experts layer)."""
    norms = _NORM_TENSORS.get(family, _NORM_TENSORS["default"])
    names = _LAYER_TENSORS | norms | (_QK_NORM_TENSORS if qk_norm else {})
    if moe:
        names = {part: path for part, path in names.items() if part not in _DENSE_MLP} | _MOE_TENSORS
    if family in _FUSED_TENSORS:
        names = {part: path for part, path in names.items() if part not in _FUSED_AWAY} | _FUSED_TENSORS[
            family
        ]
    return names


_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors llama.cpp may write that carry no model weight: the llama3 rope factors (read into the config)
# and the rotary inverse frequencies of old conversions.
_SKIPPED_TENSORS = re.compile(
    r"rope_freqs\.weight|rope_factors_(long|short)\.weight|blk\.\d+\.attn_rot_embd(\.weight)?"
)


def load_gguf(path: Path) -> ModelSource:
    """Read a GGUF file: config from its metadata, weights with HF names in torch order, tokenizer."""
    from kiln.frontend.gguf_tokenizer import tokenizer_info_from_gguf

    path = Path(path)
    where = str(path)
    reader = open_gguf(path)
    config = config_from_gguf(reader, where)
    weights = adapt_gguf_weights(config, weights_from_gguf(reader, config, where))
    name = field_value(reader, "general.name") or path.stem
    return ModelSource(
        name=str(name),
        path=path,
        config=config,
        weights=weights,
        tokenizer=tokenizer_info_from_gguf(reader, where),
    )


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Open a GGUF file, turning every way it can be missing or broken into one ModelLoadError."""
    if not path.exists():
        raise ModelLoadError(
            f"{path}: no such file", hint="pass the path of a .gguf file, or a model name `kiln pull` knows"
        )
    if path.is_dir():
        raise ModelLoadError(
            f"{path}: is a directory, not a GGUF file",
            hint="pass the .gguf file inside it, or load the directory with load_model",
        )
    with path.open("rb") as file:
        magic = file.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(
            f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')",
            hint="pass a llama.cpp .gguf model file",
        )
    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # the reader raises whatever numpy raises on short or bad bytes
        raise ModelLoadError(
            f"{path}: truncated or corrupt GGUF file ({type(error).__name__}: {error})",
            hint="download the file again",
        ) from None
    if reader.byte_order != "I":
        raise ModelLoadError(
            f"{path}: big-endian GGUF files are not supported", hint="use a little-endian GGUF file"
        )
    return reader


def field_value(reader: gguf.GGUFReader, key: str) -> Any:
    """A metadata value as a Python value (a list for arrays), or None when the key is absent."""
    field = reader.fields.get(key)
    if field is None or not field.types:
        return None
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [_scalar(field.parts[index], field.types[-1]) for index in field.data]
    return _scalar(field.parts[field.data[0]], field.types[0])


def _scalar(part: np.ndarray, value_type: gguf.GGUFValueType) -> Any:
    if value_type == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    if value_type == gguf.GGUFValueType.FLOAT32:
        return float(str(part[0]))  # the shortest decimal that round-trips: 1e-05, not 9.99999974e-06
    return part[0].item()


def _require(reader: gguf.GGUFReader, key: str, where: str) -> Any:
    value = field_value(reader, key)
    if value is None:
        raise ModelLoadError(
            f"{where}: GGUF metadata has no {key!r}", hint="the file is incomplete or not a language model"
        )
    return value


def hf_architecture(reader: gguf.GGUFReader, where: str) -> str:
    """The HF architecture for `general.architecture`; llama.cpp stores Mistral as "llama"."""
    arch = str(_require(reader, "general.architecture", where))
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(f"{gguf_name} ({hf})" for gguf_name, hf in GGUF_ARCHITECTURES.items())
        raise UnsupportedArchitectureError(
            f"{where}: GGUF architecture {arch!r} is not supported",
            hint=f"supported GGUF architectures: {supported}",
        )
    name = str(field_value(reader, "general.name") or "")
    if arch == "llama" and field_value(reader, "llama.expert_count"):
        return "MixtralForCausalLM"
    if arch == "llama" and "mistral" in name.lower():
        return "MistralForCausalLM"
    return GGUF_ARCHITECTURES[arch]


# llama.cpp's enum llama_pooling_type: the ones a decoder's embeddings take here (none, cls, rank: not)
GGUF_POOLING_TYPES = {1: "mean", 3: "last"}


def config_from_gguf(reader: gguf.GGUFReader, where: str) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (and the tensor list, for ties and biases)."""
    architecture = hf_architecture(reader, where)
    arch = str(field_value(reader, "general.architecture"))

    def key(name: str) -> Any:
        return _require(reader, f"{arch}.{name}", where)

    def optional(name: str) -> Any:
        return field_value(reader, f"{arch}.{name}")

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    head_dim = int(
        optional("attention.key_length") or optional("rope.dimension_count") or hidden // num_heads
    )
    rope_theta = float(optional("rope.freq_base") or 10000.0)
    tensor_names = {tensor.name for tensor in reader.tensors}

    def has(suffix: str) -> bool:
        return any(name.endswith(suffix) for name in tensor_names)

    family = SUPPORTED_ARCHITECTURES[architecture]
    sliding_window = optional("attention.sliding_window")
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=architecture,
        vocab_size=_vocab_size(reader, arch, where),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(optional("attention.head_count_kv") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_scaling=_rope_scaling(reader, arch, head_dim, rope_theta, where),
        sliding_window=int(sliding_window) if sliding_window else None,
        qkv_bias=family == "qwen2" or has(".attn_q.bias"),
        o_bias=has(".attn_output.bias"),
        mlp_bias=has(".ffn_up.bias"),
        qk_norm=has(".attn_q_norm.weight"),
        qk_norm_whole=family == "olmoe",
        **_moe_fields(reader, arch, where),
        **(_gemma3_fields(reader, arch, int(key("block_count")), head_dim) if family == "gemma3" else {}),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_token_ids(reader),
        pooling=GGUF_POOLING_TYPES.get(int(optional("pooling_type") or 0)),
    )


def _gemma3_fields(reader: gguf.GGUFReader, arch: str, layers: int, head_dim: int) -> dict[str, Any]:
    pattern = int(field_value(reader, f"{arch}.attention.sliding_window_pattern") or GEMMA3_SLIDING_PATTERN)
    softcap = field_value(reader, f"{arch}.final_logit_softcapping")
    return {
        "layer_types": tuple(
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ),
        "rope_local_theta": GEMMA3_LOCAL_ROPE_BASE,
        "query_pre_attn_scalar": float(head_dim),
        "final_logit_softcapping": float(softcap) if softcap else None,
    }


def _moe_fields(reader: gguf.GGUFReader, arch: str, where: str) -> dict[str, Any]:
    experts = field_value(reader, f"{arch}.expert_count")
    if not experts:
        return {}
    normalize = field_value(reader, f"{arch}.expert_weights_norm")
    inner = field_value(reader, f"{arch}.expert_feed_forward_length")
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(_require(reader, f"{arch}.expert_used_count", where)),
        "moe_intermediate_size": int(inner) if inner else None,
        "norm_topk_prob": bool(normalize) if normalize is not None else arch in GGUF_NORMALIZED_ROUTERS,
    }


def _vocab_size(reader: gguf.GGUFReader, arch: str, where: str) -> int:
    size = field_value(reader, f"{arch}.vocab_size")
    if size is not None:
        return int(size)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    raise ModelLoadError(
        f"{where}: GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens",
        hint="the file has no vocabulary; convert the model again with llama.cpp's convert_hf_to_gguf.py",
    )


def _eos_token_ids(reader: gguf.GGUFReader) -> tuple[int, ...]:
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = field_value(reader, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return tuple(ids)


def _rope_scaling(reader: gguf.GGUFReader, arch: str, head_dim: int, theta: float, where: str) -> RopeScaling:
    kind = field_value(reader, f"{arch}.rope.scaling.type")
    factor = field_value(reader, f"{arch}.rope.scaling.factor")
    factor = factor or field_value(reader, f"{arch}.rope.scale_linear")
    tensors = {t.name: t for t in reader.tensors}
    if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        return _longrope(reader, arch, tensors, where)
    rope_freqs = tensors.get("rope_freqs.weight")
    if rope_freqs is not None:
        original = field_value(reader, f"{arch}.rope.scaling.original_context_length")
        original = None if original is None else int(original)
        return _llama3_rope_scaling(np.asarray(rope_freqs.data, np.float32), head_dim, theta, original, where)
    if kind == "none" or (kind is None and factor in (None, 1.0)):
        return RopeScaling()
    if kind in (None, "linear"):
        return RopeScaling(rope_type="linear", factor=float(factor or 1.0))
    raise ModelLoadError(
        f"{where}: rope scaling {kind!r} is not supported",
        hint="supported rope scaling: none, linear, llama3 (rope_freqs tensor)",
    )


def _longrope(
    reader: gguf.GGUFReader, arch: str, tensors: dict[str, gguf.ReaderTensor], where: str
) -> RopeScaling:
    """Phi-3's longrope: the factor tensors llama.cpp's converter writes, and the original context."""
    missing = [n for n in ("rope_factors_long.weight", "rope_factors_short.weight") if n not in tensors]
    original = field_value(reader, f"{arch}.rope.scaling.original_context_length")
    if missing or not original:
        raise ModelLoadError(
            f"{where}: longrope needs both rope factor tensors and "
            f"{arch}.rope.scaling.original_context_length"
            + (f" (missing {', '.join(missing)})" if missing else ""),
            hint="the file is incomplete; convert the model again with llama.cpp's convert_hf_to_gguf.py",
        )
    attention = field_value(reader, f"{arch}.rope.scaling.attn_factor")
    if attention is None:
        context = int(_require(reader, f"{arch}.context_length", where))
        attention = longrope_attention_factor(context / int(original), int(original))

    def factors(name: str) -> tuple[float, ...]:
        return tuple(float(f) for f in np.asarray(tensors[name].data, np.float32).reshape(-1))

    return RopeScaling(
        rope_type="longrope",
        original_max_position_embeddings=int(original),
        short_factor=factors("rope_factors_short.weight"),
        long_factor=factors("rope_factors_long.weight"),
        attention_factor=float(attention),
    )


def _llama3_rope_scaling(
    rope_freqs: np.ndarray, head_dim: int, theta: float, original: int | None, where: str
) -> RopeScaling:
    """Recover HF's llama3 rope parameters from llama.cpp's per-frequency `rope_freqs` factors.

    llama.cpp stores only the factors: the factor is their maximum, the low and high frequency factors
    are every Llama 3.x release's (1 and 4), and the original context is the file's
    `rope.scaling.original_context_length`, else Llama 3's 8192, else the one the factors themselves
    give (the factors fix the two wavelengths where scaling starts and ends, original / 4 and
    original / 1): each is accepted only if it reproduces the stored factors.
    """
    factor = float(rope_freqs.max())
    candidates = (
        [original] if original is not None else [8192, _llama3_original_context(rope_freqs, head_dim, theta)]
    )
    for context in candidates:
        scaling = RopeScaling(
            rope_type="llama3",
            factor=factor,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=context or 8192,
        )
        expected = _llama3_rope_factors(scaling, head_dim, theta)
        if expected.shape == rope_freqs.shape and np.allclose(expected, rope_freqs, rtol=1e-5, atol=1e-6):
            return scaling
    raise ModelLoadError(
        f"{where}: rope_freqs tensor does not match llama3 rope scaling with factor {factor}, "
        f"low_freq_factor 1, high_freq_factor 4 and any original context "
        f"({', '.join(str(c) for c in candidates if c)})",
        hint="this rope scaling is not supported; use the HF checkpoint with its config.json",
    )


def _llama3_original_context(rope_freqs: np.ndarray, head_dim: int, theta: float) -> int | None:
    """The original context that llama3 scaling (low 1, high 4) of these factors implies: from a
    frequency scaled part-way, original = wavelength * (1 + 3 * smooth); where none is, the smallest
    original whose high-frequency bound (original / 4) lies above every unscaled wavelength."""
    factor = float(rope_freqs.max())
    wavelengths = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    if factor <= 1.0 or rope_freqs.shape != wavelengths.shape:
        return None
    between = (rope_freqs > 1.0 + 1e-6) & (rope_freqs < factor * (1 - 1e-6))
    if between.any():
        smooth = (1 / rope_freqs[between] - 1 / factor) / (1 - 1 / factor)
        return round(float(np.median(wavelengths[between] * (1 + 3 * smooth))))
    unscaled = wavelengths[rope_freqs <= 1.0 + 1e-6]
    return math.floor(4 * float(unscaled.max())) + 1 if unscaled.size else None


def _llama3_rope_factors(scaling: RopeScaling, head_dim: int, theta: float) -> np.ndarray:
    """The factors llama.cpp's convert_hf_to_gguf.py writes to `rope_freqs` for llama3 rope scaling."""
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(scaling.factor)
        else:
            smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / scaling.factor + smooth))
    return np.asarray(factors, np.float32)


def hf_tensor_name(gguf_name: str, config: ModelConfig, where: str) -> str | None:
    """The HF name of a GGUF tensor, or None for tensors that carry no weight."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if _SKIPPED_TENSORS.fullmatch(gguf_name):
        return None
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    names = layer_names(config.family, config.qk_norm, match is not None and config.is_moe(int(match[1])))
    if match is None or match.group(2) not in names:
        raise ModelLoadError(
            f"{where}: unexpected tensor {gguf_name!r}",
            hint="this GGUF holds weights the Llama-family definition has no place for",
        )
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


def weights_from_gguf(reader: gguf.GGUFReader, config: ModelConfig, where: str) -> dict[str, Weight]:
    """Every tensor under its HF name, in torch order, with llama.cpp's Q/K row permutation undone."""
    permuted = str(field_value(reader, "general.architecture")) == "llama"
    weights: dict[str, Weight] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, config, where)
        if name is None:
            continue
        weight = reader_tensor(tensor, where)
        heads = _permuted_heads(name, config) if permuted else None
        if heads is not None:
            _check_rows(weight, heads * config.head_dim, name, where)
            weight = unpermute_rows(weight, heads)
        weights[name] = weight
    _check_complete(weights, config, where)
    return weights


def _permuted_heads(name: str, config: ModelConfig) -> int | None:
    """How many heads llama.cpp permuted the rows of this weight by (None: it left it alone)."""
    if ".self_attn.q_proj." in name:
        return config.num_attention_heads
    if ".self_attn.k_proj." in name:
        return config.num_key_value_heads
    return None


def _check_rows(weight: Weight, rows: int, name: str, where: str) -> None:
    if weight.shape[0] != rows:
        raise ModelLoadError(
            f"{where}: {name} has {weight.shape[0]} rows, but the metadata's heads × head_dim is {rows}",
            hint="the file's metadata does not match its tensors; convert the model again",
        )


def reader_tensor(tensor: gguf.ReaderTensor, where: str) -> Weight:
    """One reader tensor, still in the mapped file: a float one deferred (read when materialized),
    a quantized one as its blocks (read when imported). `tensor.data` is in torch (row-major) order."""
    kind = tensor.tensor_type.name
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    data = tensor.data
    if kind in ("F32", "F16", "BF16"):
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind]
        return Deferred(shape, dtype, lambda: _read_float(data, dtype, shape))
    if kind in QUANTIZED_TYPES:
        rows = math.prod(shape[:-1])
        return QuantizedTensor(ggml_type=kind, shape=shape, blocks=data.reshape(rows, -1))
    raise ModelLoadError(
        f"{where}: tensor {tensor.name!r} has type {kind}, which Kiln cannot load",
        hint=f"use a GGUF whose tensors are F32, F16, BF16 or {', '.join(QUANTIZED_TYPES)} (e.g. a Q4_K_M, "
        "Q5_K_M, Q6_K or Q8_0 file; llama.cpp's llama-quantize converts between types)",
    )


def _read_float(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    values = np.array(data)
    let_go(data)
    if dtype == torch.bfloat16:
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(values).reshape(shape)


def unpermute_rows(weight: Weight, n_head: int) -> Weight:
    """Undo llama.cpp's interleaved-rope permutation of Q/K rows (as transformers' GGUF loader does).

    Works on whole rows, so a QuantizedTensor's rows of blocks move just like a float tensor's rows
    (recorded as its row order: nothing is read here)."""
    order = _unpermuted_order(int(weight.shape[0]), n_head)
    if isinstance(weight, QuantizedTensor):
        held = weight.row_order
        return QuantizedTensor(
            weight.ggml_type, weight.shape, weight.blocks, order if held is None else held[order]
        )
    if isinstance(weight, Deferred):
        return weight.then(weight.shape, weight.dtype, lambda values: values[torch.from_numpy(order)])
    return weight[torch.from_numpy(order)].contiguous()


def _unpermuted_order(rows: int, n_head: int) -> np.ndarray:
    """Row i of the unpermuted weight is row order[i] of llama.cpp's."""
    dim = rows // n_head // 2
    return np.arange(rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(rows)


def _check_complete(weights: dict[str, Weight], config: ModelConfig, where: str) -> None:
    expected = ["model.embed_tokens.weight", "model.norm.weight"]
    for layer in range(config.num_hidden_layers):
        parts = layer_names(config.family, config.qk_norm, config.is_moe(layer)).values()
        expected += [f"model.layers.{layer}.{part}.weight" for part in parts]
    missing = [name for name in expected if name not in weights]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelLoadError(
            f"{where}: GGUF lacks weights the config needs: {shown}",
            hint="the file is incomplete or was converted from a different architecture",
        )
