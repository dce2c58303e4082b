"""Gemma 3 (text) in plain torch.nn: embeddings scaled by sqrt(hidden), RMSNorm with (1 + w), norms
before and after attention and the MLP, RMSNorm on each head's q and k, GeGLU (gelu-tanh), sliding-window
and full-attention layers with their own rope bases, attention scale query_pre_attn_scalar**-0.5, and
tanh soft-capping of the logits where the config has it.

Parameter names follow Hugging Face's. The norm weights hold 1 + w (as GGUF files store them); HF
checkpoints store w, and `from_hf_weights` adds the 1 at load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.frontend.config import ModelConfig
from kiln.frontend.models.llama import Attention, LlamaForCausalLM, RMSNorm
from kiln.frontend.models.step import StepTensors
from kiln.frontend.ops import gelu_tanh
from kiln.ir.deferred import Deferred, Weight


def from_hf_weights(config: ModelConfig, weights: dict[str, Weight]) -> dict[str, Weight]:
    """HF Gemma norms compute x * (1 + w): store 1 + w (float32, as HF adds it) so RMSNorm multiplies."""
    return {
        name: _one_plus(tensor) if name.endswith("norm.weight") else tensor
        for name, tensor in weights.items()
    }


def _one_plus(weight: Weight) -> Weight:
    if isinstance(weight, Deferred):
        return weight.then(weight.shape, weight.dtype, lambda values: (1.0 + values.float()).to(values.dtype))
    return (1.0 + weight.float()).to(weight.dtype)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = gelu_tanh(F.linear(x, self.gate_proj.weight))
        return F.linear(gate * F.linear(x, self.up_proj.weight), self.down_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(config)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(self, h: torch.Tensor, step: StepTensors) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), step))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = DecoderLayer
    scales_embeddings = True
