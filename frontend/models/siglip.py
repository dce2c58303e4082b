"""SigLIP's vision tower in plain torch.nn, as Gemma 3 and Idefics3 (SmolVLM) use it: one image's
patches (no class token, no padding) through a patch embedding with bias, positions, the ViT layers
of clip_vision.py and the post-norm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from kiln.frontend.models.clip_vision import (
    EncoderLayer,
    LayerNorm,
    encoder_layer_weights,
    flat_patches,
    linear,
)
from kiln.ir import TensorType


@dataclass(frozen=True)
class SiglipConfig:
    """A SigLIP tower's settings and the text model's width its projector maps into; each family's
    config adds its projector's own (Gemma 3, Idefics3)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_layers: int
    image_size: int  # an image's (or a tile's) side
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    text_hidden_size: int

    @staticmethod
    def fields_of(config: dict[str, Any], text_width: int) -> dict[str, Any]:
        """The base fields from a vision-language config.json (`vision_config`, `text_config`)."""
        vision, text = config["vision_config"], config.get("text_config") or {}
        return {
            "hidden_size": int(vision["hidden_size"]),
            "intermediate_size": int(vision["intermediate_size"]),
            "num_attention_heads": int(vision["num_attention_heads"]),
            "num_layers": int(vision["num_hidden_layers"]),
            "image_size": int(vision["image_size"]),
            "patch_size": int(vision["patch_size"]),
            "layer_norm_eps": float(vision.get("layer_norm_eps", 1e-6)),
            "hidden_act": vision.get("hidden_act", "gelu_pytorch_tanh"),
            "text_hidden_size": int(text.get("hidden_size", text_width)),
        }

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_rows(self) -> int:
        return self.grid * self.grid

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size * self.patch_size


class SiglipTower(nn.Module):
    """SigLIP's ViT over one image's patches (no class token, no padding): patch embedding with bias,
    positions, the layers, the post-norm. Gemma 3 and Idefics3 take its last hidden state."""

    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Linear(config.patch_dim, config.hidden_size)
        self.positions = nn.Parameter(torch.zeros(config.num_rows, config.hidden_size))
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))
        self.post_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = linear(self.patch_embedding, patches) + self.positions
        for layer in self.layers:
            x = layer(x, None)
        return self.post_layernorm(x)


def siglip_weights(
    config: SiglipConfig, tower: dict[str, torch.Tensor], prefix: str
) -> dict[str, torch.Tensor]:
    """A SiglipTower's state dict (its names under `prefix`) from the tower's HF tensors."""
    patch = tower["embeddings.patch_embedding.weight"]
    state = {
        "patch_embedding.weight": patch.reshape(patch.shape[0], -1),
        "patch_embedding.bias": tower["embeddings.patch_embedding.bias"],
        "positions": tower["embeddings.position_embedding.weight"],
        "post_layernorm.weight": tower["post_layernorm.weight"],
        "post_layernorm.bias": tower["post_layernorm.bias"],
    }
    for i in range(config.num_layers):
        state |= encoder_layer_weights(tower, i)
    return {prefix + name: tensor for name, tensor in state.items()}


def input_types(config: SiglipConfig) -> dict[str, TensorType]:
    """The encoder's one input: every patch of one image (or tile), no padding."""
    return {"patches": TensorType("f32", (config.num_rows, config.patch_dim))}


def encoder_inputs(pixel_values: npt.NDArray[np.float32], patch_size: int) -> dict[str, npt.NDArray[Any]]:
    """The encoder's input for one image's (or tile's) [3, H, W] pixel values: every patch, flattened."""
    return {"patches": flat_patches(pixel_values, patch_size)}
