"""The model configuration every Llama-family definition is parameterised by."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import ModelLoadError, UnsupportedArchitectureError

# the files older GPTQ and AWQ tools write beside config.json instead of a quantization_config, and the
# method each names (frontend/hf_quantization.py reads them)
QUANTIZATION_SIDE_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}

# HF `architectures[0]` (and GGUF `general.architecture`) → our family name.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
# bare decoders, as embedding models are saved (Qwen3-Embedding, gte-Qwen2, e5-mistral): no LM head
BARE_DECODERS: dict[str, str] = {
    "LlamaModel": "llama",
    "MistralModel": "mistral",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
}
SUPPORTED_ARCHITECTURES.update(BARE_DECODERS)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
SLIDING_LAYER = "sliding_attention"  # HF `layer_types`


@dataclass(frozen=True)
class RopeScaling:
    """HF `rope_scaling` for the kinds we support ("default" means none). longrope (Phi-3): a factor per
    frequency pair, the short ones for contexts within original_max_position_embeddings, the long ones
    beyond, and cos and sin scaled by attention_factor."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """What a Llama-family model needs to be built; field names follow HF `config.json`."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES' keys
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    sliding_window: int | None = None
    qkv_bias: bool = False  # Qwen2; Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's q and k (head_dim weights) before rope
    # Gemma 3: "sliding_attention" / "full_attention" a layer (empty: every layer alike, windowed if
    # sliding_window is set); the sliding layers' rope base; attention scale query_pre_attn_scalar**-0.5;
    # tanh soft-capping of the logits
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    qk_norm_whole: bool = False  # OLMoE: the q and k norms span all heads' values, not each head's
    # mixture of experts (num_experts > 0): a layer's MLP is `num_experts_per_tok` of the experts, each
    # a SwiGLU of `moe_intermediate_size` (default intermediate_size), except in `mlp_only_layers` and
    # in layers off every `decoder_sparse_step`th (Qwen3-MoE), which keep a dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # the step takes image rows: token ids >= vocab_size stand for rows of its `image_rows` input
    image_rows: bool = False
    # and each image's tokens attend to one another both ways: its `visible_ends` input (Gemma 3)
    bidirectional_images: bool = False
    # an embedding model's pooling, "last" or "mean" (sentence-transformers' Pooling module, GGUF's
    # pooling_type); None: a generative model (embeddings then default to "last")
    pooling: str | None = None

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def is_local(self, layer: int) -> bool:
        """A sliding-window layer among full ones (Gemma 3): its own rope base, no rope scaling."""
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING_LAYER

    def sliding_window_of(self, layer: int) -> int | None:
        if self.layer_types and not self.is_local(layer):
            return None
        return self.sliding_window

    def is_moe(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["eos_token_ids"] = list(self.eos_token_ids)
        data["layer_types"] = list(self.layer_types)
        data["mlp_only_layers"] = list(self.mlp_only_layers)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        rope = dict(data.get("rope_scaling") or {})
        for name in ("short_factor", "long_factor"):
            rope[name] = tuple(rope.get(name) or ())
        data["rope_scaling"] = RopeScaling(**rope)
        data["eos_token_ids"] = tuple(data.get("eos_token_ids") or ())
        data["layer_types"] = tuple(data.get("layer_types") or ())
        data["mlp_only_layers"] = tuple(data.get("mlp_only_layers") or ())
        return cls(**data)


def check_architecture(name: str, where: str) -> str:
    if name not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise UnsupportedArchitectureError(
            f"{where}: architecture {name!r} is not supported",
            hint=f"supported architectures: {supported}",
        )
    return name


def rope_scaling_from_hf(
    raw: dict[str, Any] | None, where: str, config: dict[str, Any] | None = None
) -> RopeScaling:
    """`config`: the whole config.json, for longrope's context lengths."""
    if not raw:
        return RopeScaling()
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    if rope_type == "su":  # longrope's earlier name
        rope_type = "longrope"
    if rope_type == "longrope":
        return _longrope_from_hf(raw, config or {}, where)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{where}: rope scaling {rope_type!r} is not supported",
            hint=f"supported rope scaling types: {', '.join(SUPPORTED_ROPE_TYPES)}",
        )
    return RopeScaling(
        rope_type=rope_type,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


def longrope_attention_factor(scale: float, original: int) -> float:
    """HF's default: sqrt(1 + ln(scale) / ln(original)), scale the context's growth (1 when <= 1)."""
    return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))


def _longrope_from_hf(raw: dict[str, Any], config: dict[str, Any], where: str) -> RopeScaling:
    original = raw.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    if not original or not raw.get("short_factor") or not raw.get("long_factor"):
        raise ModelLoadError(
            f"{where}: longrope needs short_factor, long_factor and original_max_position_embeddings",
            hint="the config is incomplete; use the model's config.json as published",
        )
    factor = raw.get("factor") or int(config.get("max_position_embeddings", original)) / int(original)
    attention = raw.get("attention_factor")
    if attention is None:
        attention = longrope_attention_factor(float(factor), int(original))
    return RopeScaling(
        rope_type="longrope",
        original_max_position_embeddings=int(original),
        short_factor=tuple(float(f) for f in raw["short_factor"]),
        long_factor=tuple(float(f) for f in raw["long_factor"]),
        attention_factor=float(attention),
    )


def config_from_hf(raw: dict[str, Any], where: str) -> ModelConfig:
    """Build a ModelConfig from a HF `config.json` dict (`where` names the file for errors)."""
    architectures = raw.get("architectures") or [raw.get("model_type", "<none>")]
    architecture = check_architecture(architectures[0], where)
    try:
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        family = SUPPORTED_ARCHITECTURES[architecture]
        sliding_window = raw.get("sliding_window")
        if family in ("qwen2", "qwen3", "qwen3_moe") and not raw.get("use_sliding_window", False):
            sliding_window = None
        rope_params = raw.get("rope_parameters") or {}
        local_theta = None
        if family == "gemma3":  # rope parameters a layer type
            local_theta = float((rope_params.get("sliding_attention") or {}).get("rope_theta", 10000.0))
            rope_params = rope_params.get("full_attention") or {}
        rope_raw = raw.get("rope_scaling") or (rope_params if rope_params.get("rope_type") else None)
        rope_theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rotary = float(raw.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor") or 1.0)
        if rotary != 1.0:
            raise ModelLoadError(
                f"{where}: partial rotary embeddings (partial_rotary_factor {rotary}) are not supported",
                hint="Kiln rotates every dimension of a head (Phi-3; not yet Phi-4-mini's 0.75)",
            )
        attention_bias = bool(raw.get("attention_bias", False))
        if raw.get("clip_qkv") is not None:
            raise ModelLoadError(
                f"{where}: clip_qkv {raw['clip_qkv']} is not supported",
                hint="Kiln does not clamp q, k and v; OLMoE releases leave clip_qkv null",
            )
        return ModelConfig(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling_from_hf(rope_raw, where, raw),
            sliding_window=int(sliding_window) if sliding_window else None,
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family != "qwen2" and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "gemma3", "qwen3_moe", "olmoe"),
            qk_norm_whole=family == "olmoe",
            layer_types=tuple(raw.get("layer_types") or ()) if family == "gemma3" else (),
            rope_local_theta=local_theta,
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar") if family == "gemma3" else None,
            final_logit_softcapping=raw.get("final_logit_softcapping") if family == "gemma3" else None,
            **_moe_fields(raw, family),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    except KeyError as missing:
        raise ModelLoadError(
            f"{where}: config has no {missing.args[0]!r}", hint="is this a Llama-family config.json?"
        ) from None


def _moe_fields(raw: dict[str, Any], family: str) -> dict[str, Any]:
    if family not in ("mixtral", "qwen3_moe", "olmoe"):
        return {}
    return {
        "num_experts": int(raw.get("num_local_experts") or raw["num_experts"]),
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": raw.get("moe_intermediate_size"),
        "norm_topk_prob": family == "mixtral" or bool(raw.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(raw.get("decoder_sparse_step") or 1),
        "mlp_only_layers": tuple(int(layer) for layer in raw.get("mlp_only_layers") or ()),
    }
