"""What a loader hands to the rest of the frontend: config, weights, tokenizer data."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kiln.frontend.config import ModelConfig


@dataclass(frozen=True)
class QuantizedTensor:
    """A weight kept in its GGUF block layout, so quantization passes can import it as is.

    `shape` is in torch order ([out_features, in_features] for a linear weight); `blocks` are the raw
    GGUF bytes, one row of blocks per output row.
    """

    ggml_type: str  # "Q4_0", "Q4_1", "Q8_0", "Q4_K", ... (gguf_loader.QUANTIZED_TYPES)
    shape: tuple[int, ...]
    blocks: np.ndarray  # uint8

    def dequantize(self) -> torch.Tensor:
        """Float32 values, bit-identical to `gguf.quants.dequantize`."""
        import gguf

        qtype = gguf.GGMLQuantizationType[self.ggml_type]
        values = gguf.quants.dequantize(self.blocks, qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(self.shape)


Weight = torch.Tensor | QuantizedTensor


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
class ModelSource:
    """A loaded model: HF-named weights (`model.layers.0.self_attn.q_proj.weight`), config, tokenizer."""

    name: str
    path: Path
    config: ModelConfig
    weights: dict[str, Weight]
    tokenizer: TokenizerInfo

    def float_weights(self) -> dict[str, torch.Tensor]:
        """All weights as float32 tensors (quantized ones dequantized)."""
        return {
            name: w.dequantize() if isinstance(w, QuantizedTensor) else w.to(torch.float32)
            for name, w in self.weights.items()
        }
