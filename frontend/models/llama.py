"""The Llama family in plain torch.nn: Llama 2/3, SmolLM2, Mistral (sliding window), Qwen2 (QKV bias),
Qwen3 (RMSNorm on each head's q and k before rope), and with a mixture-of-experts MLP (moe.py) Mixtral,
Qwen3-MoE and OLMoE (q and k norms over all heads); its attention serves Gemma 3 too (gemma3.py).

Parameter names follow Hugging Face's, so HF state dicts load as they are. `forward` is the DESIGN.md
step: a ragged batch of sequences over the paged KV cache, returning logits for `logits_indices`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.frontend.config import ModelConfig, RopeScaling
from kiln.frontend.models.moe import SparseMoeBlock
from kiln.frontend.models.step import StepTensors
from kiln.frontend.ops import embedding_with_rows, paged_attention, rms_norm, rope, scale, softcap
from kiln.ir.step import IMAGE_ROWS_INPUT, VISIBLE_ENDS_INPUT, VISIBLE_ENDS_TYPE
from kiln.ir.types import TensorType


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, eps=self.eps)


def _rope_scaling_attrs(scaling: RopeScaling, context: int) -> dict[str, float | str | list[float]]:
    """`context`: the longest sequence the model serves; longrope takes its long factors beyond the
    original context (as llama.cpp chooses by its context size; HF by each sequence's length)."""
    if scaling.rope_type == "default":
        return {}
    if scaling.rope_type == "longrope":
        long = context > scaling.original_max_position_embeddings
        factors = scaling.long_factor if long else scaling.short_factor
        return {
            "rope_type": "longrope",
            "factors": list(factors),
            "attention_factor": scaling.attention_factor,
        }
    attrs: dict[str, float | str | list[float]] = {"rope_type": scaling.rope_type, "factor": scaling.factor}
    if scaling.rope_type == "llama3":
        attrs |= {
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
    return attrs


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = float(config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.sliding_window = config.sliding_window_of(layer)
        local = config.is_local(layer)  # Gemma's sliding layers: their own rope base, unscaled
        theta = config.rope_local_theta if local and config.rope_local_theta else config.rope_theta
        scaling = {} if local else _rope_scaling_attrs(config.rope_scaling, config.max_position_embeddings)
        self.rope_attrs = {"theta": theta} | scaling
        hidden, q_size, kv_size = (
            config.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        self.q_proj = nn.Linear(hidden, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_bias)
        self.norms_heads = not config.qk_norm_whole  # each head's values, or all heads' at once (OLMoE)
        q_norm_size, k_norm_size = (self.head_dim, self.head_dim) if self.norms_heads else (q_size, kv_size)
        self.q_norm = RMSNorm(q_norm_size, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(k_norm_size, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, step: StepTensors) -> torch.Tensor:
        q = F.linear(x, self.q_proj.weight, self.q_proj.bias)
        k = F.linear(x, self.k_proj.weight, self.k_proj.bias)
        if self.q_norm is not None and self.k_norm is not None and not self.norms_heads:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = F.linear(x, self.v_proj.weight, self.v_proj.bias).view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and self.norms_heads:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = rope(q, step.positions, **self.rope_attrs)
        k = rope(k, step.positions, **self.rope_attrs)
        out = paged_attention(
            q,
            k,
            v,
            *step.attention_inputs(),
            layer=self.layer,
            scale=self.scale,
            sliding_window=self.sliding_window,
        )
        out = out.view(-1, self.num_heads * self.head_dim)
        return F.linear(out, self.o_proj.weight, self.o_proj.bias)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.silu(F.linear(x, self.gate_proj.weight, self.gate_proj.bias))
        up = F.linear(x, self.up_proj.weight, self.up_proj.bias)
        return F.linear(gate * up, self.down_proj.weight, self.down_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoeBlock(config) if config.is_moe(layer) else MLP(config)

    def forward(self, h: torch.Tensor, step: StepTensors) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), step)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, layer_class: type[nn.Module] = DecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The step over the decoder layers. A family that differs in its layers subclasses this with its
    own `layer_class` (gemma3.py); the embedding scale and the logits' soft-capping are Gemma's."""

    layer_class: type[nn.Module] = DecoderLayer
    scales_embeddings = False  # by sqrt(hidden)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.layer_class)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @staticmethod
    def optional_inputs(config: ModelConfig) -> dict[str, TensorType]:
        """The optional step inputs (ir/step.py OPTIONAL_INPUTS) this config's step takes, by name."""
        image_rows = (
            {IMAGE_ROWS_INPUT: TensorType("f32", ("E", config.hidden_size))} if config.image_rows else {}
        )
        ends = {VISIBLE_ENDS_INPUT: VISIBLE_ENDS_TYPE} if config.bidirectional_images else {}
        return {**image_rows, **ends}

    def forward(self, step: StepTensors) -> torch.Tensor:
        """Logits of the `logits_indices` rows. A vision-language model's step takes image rows: a token id
        of vocab_size + e stands for row e (an image's embeddings, placed by the runtime; not scaled with
        the text's embeddings: a family that scales them, as Gemma does, gets rows divided by the scale
        first)."""
        rows = step.image_rows
        if rows is None:
            h = F.embedding(step.token_ids, self.model.embed_tokens.weight)
        else:
            if self.scales_embeddings:
                rows = scale(rows, factor=self.config.hidden_size**-0.5)
            h = embedding_with_rows(self.model.embed_tokens.weight, step.token_ids, rows)
        if self.scales_embeddings:
            h = scale(h, factor=self.config.hidden_size**0.5)
        for layer in self.model.layers:
            h = layer(h, step)
        h = self.model.norm(h)
        head = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        logits = F.linear(h, head)
        logits = torch.index_select(logits, 0, step.logits_indices)
        if self.config.final_logit_softcapping:  # after the rows are taken: fewer values to cap
            logits = softcap(logits, cap=self.config.final_logit_softcapping)
        return logits
