"""What a loader hands to the rest of the frontend: config, weights, tokenizer data."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from kiln.frontend.config import ModelConfig
from kiln.ir import TensorType
from kiln.ir.deferred import Deferred
from kiln.ir.gguf_blocks import QuantizedTensor  # loaders make them, passes import them
from kiln.ir.vision import VisionSpec

Weight = torch.Tensor | Deferred | QuantizedTensor


@dataclass(frozen=True)
class TokenizerInfo:
    """Everything the runtime needs to tokenize and apply the chat template, as plain data.

    `tokenizer_json` is a serialized `tokenizers.Tokenizer`; the runtime rebuilds it from this string.
    """

    tokenizer_json: str
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    eos_token_ids: tuple[int, ...]
    special_tokens: dict[str, str] = field(default_factory=dict)  # e.g. {"pad_token": "<|endoftext|>"}


@dataclass
class VisionSource:
    """A vision-language model's image encoder as loaded (frontend/vision.py): `module` with its weights,
    called with `input_types`; `spec`, what the runtime needs besides the compiled encoder."""

    spec: VisionSpec
    module: nn.Module
    input_types: dict[str, TensorType]


@dataclass
class ModelSource:
    """A loaded model: HF-named weights (`model.layers.0.self_attn.q_proj.weight`), config, tokenizer."""

    name: str
    path: Path
    config: ModelConfig
    weights: dict[str, Weight]
    tokenizer: TokenizerInfo
    vision: VisionSource | None = None  # a vision-language model's image encoder

    def float_weights(self) -> dict[str, torch.Tensor | Deferred]:
        """All weights as float32, deferred (ir/deferred.py) where that takes work: quantized ones are
        dequantized, others converted, when a pass or the artifact writer asks for their values."""
        return {name: float32(weight) for name, weight in self.weights.items()}


def float32(weight: Weight) -> torch.Tensor | Deferred:
    """A weight as float32: as it is where it already is, else deferred."""
    if isinstance(weight, QuantizedTensor):
        return weight.deferred()
    if isinstance(weight, Deferred):
        return weight.to(torch.float32)
    if weight.dtype == torch.float32:
        return weight
    return Deferred(weight.shape, torch.float32, lambda: weight.to(torch.float32))
