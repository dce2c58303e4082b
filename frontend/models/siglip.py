"""SigLIP's vision tower in plain torch.nn, as Gemma 3 and Idefics3 (SmolVLM) use it: one image's
patches (no class token, no padding) through a patch embedding with bias, positions, the ViT layers
of clip_vision.py and the post-norm."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from kiln.frontend.models.clip_vision import (
    EncoderLayer,
    LayerConfig,
    LayerNorm,
    encoder_layer_weights,
    linear,
)


class VitConfig(LayerConfig, Protocol):
    """What a SiglipTower needs of its model's config."""

    num_layers: int

    @property
    def patch_dim(self) -> int: ...

    @property
    def num_rows(self) -> int: ...


class SiglipTower(nn.Module):
    """SigLIP's ViT over one image's patches (no class token, no padding): patch embedding with bias,
    positions, the layers, the post-norm. Gemma 3 and Idefics3 take its last hidden state."""

    def __init__(self, config: VitConfig) -> None:
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


def siglip_weights(config: VitConfig, tower: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
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
