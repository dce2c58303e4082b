"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE, OLMoE): a router linear and one `moe` op over the
stacked experts, so that backends lower the whole block at once and read only the chosen experts.

HF checkpoints store each expert's projections apart (`mlp.experts.3.gate_proj.weight`; Mixtral
`block_sparse_moe.experts.3.w1.weight`); `stack_experts` stacks them at load into
`mlp.experts.gate_proj.weight` [E, I, H] (GGUF files hold them stacked already: `ffn_gate_exps`).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kiln.frontend.config import ModelConfig
from kiln.frontend.ops import moe
from kiln.ir.deferred import Weight, stacked
from kiln.ir.gguf_blocks import QuantizedTensor


class ExpertWeights(nn.Module):
    def __init__(self, experts: int, rows: int, columns: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, rows, columns))


class Experts(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        experts, hidden, inner = config.num_experts, config.hidden_size, config.expert_intermediate_size
        self.gate_proj = ExpertWeights(experts, inner, hidden)
        self.up_proj = ExpertWeights(experts, inner, hidden)
        self.down_proj = ExpertWeights(experts, hidden, inner)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = Experts(config)
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(x, self.gate.weight)
        return moe(
            x,
            router_logits,
            self.experts.gate_proj.weight,
            self.experts.up_proj.weight,
            self.experts.down_proj.weight,
            top_k=self.top_k,
            normalize=self.normalize,
        )


_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT = re.compile(r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")


def stack_experts(config: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """Per-expert HF tensors → one [E, N, K] tensor a projection; Mixtral's names → the others'."""
    experts: dict[tuple[str, str], dict[int, Weight]] = {}
    adapted: dict[str, Any] = {}
    for name, tensor in weights.items():
        match = _EXPERT.fullmatch(name)
        if match is None:
            adapted[name.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = tensor
            continue
        prefix, index, part = match.groups()
        experts.setdefault((prefix, _MIXTRAL_NAMES.get(part, part)), {})[int(index)] = tensor
    for (prefix, part), by_index in experts.items():
        if sorted(by_index) != list(range(config.num_experts)):
            continue  # incomplete: build_model names what is missing
        adapted[f"{prefix}.mlp.experts.{part}.weight"] = _stacked([by_index[i] for i in sorted(by_index)])
    return adapted


def _stacked(weights: list[Any]) -> Any:
    """Experts stacked; a pre-quantized checkpoint's blocks stay blocks where every expert has the same
    type (as a GGUF's stacked experts are), else each is its float values."""
    first = weights[0]
    if all(isinstance(w, QuantizedTensor) and w.ggml_type == first.ggml_type for w in weights):
        shape = (len(weights), *first.shape)
        return QuantizedTensor(
            first.ggml_type, shape, lambda: np.concatenate([w.read() for w in weights]), origin=first.origin
        )
    return stacked([w.deferred() if isinstance(w, QuantizedTensor) else w for w in weights])
