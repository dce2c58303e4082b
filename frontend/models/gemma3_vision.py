"""Gemma 3's image encoder in plain torch.nn: a SigLIP ViT (all layers, then its post-norm), an average
pool of the patch grid down to `mm_tokens_per_image` tokens, Gemma's RMSNorm and the projection into
the text model's hidden size.

Every image has the same fixed grid (896 / 14 = 64 x 64 patches on the real model), so the rows are
not padded and attention sees them all. The pool is a constant matrix applied to the transposed rows
(a linear map, so no pooling op): `pool[t, p]` is 1 / k^2 where patch p lies in token t's k x k square.
Gemma's norm weight w is stored as 1 + w, as the text model's are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.errors import ModelLoadError
from kiln.frontend.models.clip_vision import linear, tower_tensors
from kiln.frontend.models.siglip import (  # noqa: F401  (input_types, encoder_inputs: this family's)
    SiglipConfig,
    SiglipTower,
    encoder_inputs,
    input_types,
    siglip_weights,
)
from kiln.frontend.ops import rms_norm

ARCHITECTURE = "Gemma3ForConditionalGeneration"


@dataclass(frozen=True)
class Gemma3VisionConfig(SiglipConfig):
    tokens_per_image: int

    @classmethod
    def from_gemma3(cls, config: dict[str, Any]) -> Gemma3VisionConfig:
        """From a Gemma3ForConditionalGeneration config.json."""
        fields = SiglipConfig.fields_of(config, text_width=2560)
        made = cls(**fields, tokens_per_image=int(config.get("mm_tokens_per_image", 256)))
        side = round(made.tokens_per_image**0.5)
        if side * side != made.tokens_per_image or made.grid % side:
            raise ModelLoadError(
                f"mm_tokens_per_image {made.tokens_per_image} does not pool a {made.grid} x {made.grid} grid"
            )
        if made.num_rows % 4 or made.hidden_size % 4:
            raise ModelLoadError(
                f"a {made.grid} x {made.grid} grid of width {made.hidden_size}: not in rows of 4"
            )
        return made


class Gemma3VisionProjector(nn.Module):
    def __init__(self, config: Gemma3VisionConfig) -> None:
        super().__init__()
        self.tower = SiglipTower(config)
        self.pool = nn.Parameter(torch.zeros(config.tokens_per_image, config.num_rows))
        self.soft_emb_norm = nn.Parameter(torch.ones(config.hidden_size))  # 1 + Gemma's w
        self.projection = nn.Linear(config.hidden_size, config.text_hidden_size, bias=False)
        self.eps = config.layer_norm_eps

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.tower(patches)
        pooled = torch.nn.functional.linear(x.t(), self.pool).t()  # [tokens, hidden]
        return linear(self.projection, rms_norm(pooled, self.soft_emb_norm, eps=self.eps))


def pool_matrix(grid: int, tokens: int) -> torch.Tensor:
    """[tokens, grid * grid]: each token the mean of its k x k square of patches (row-major both)."""
    side = round(tokens**0.5)
    k = grid // side
    rows = torch.arange(grid * grid)
    token_of_patch = (rows // grid // k) * side + (rows % grid) // k
    pool = torch.zeros(tokens, grid * grid)
    pool[token_of_patch, rows] = 1.0 / (k * k)
    return pool


def from_gemma3_weights(
    config: Gemma3VisionConfig, weights: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The encoder's state dict from a Gemma 3 checkpoint's tensors (the SigLIP head, unused, left out)."""
    tower, projector = tower_tensors(weights)
    try:
        return siglip_weights(config, tower, "tower.") | {
            "pool": pool_matrix(config.grid, config.tokens_per_image),
            "soft_emb_norm": 1.0 + projector["mm_soft_emb_norm.weight"].float(),
            "projection.weight": projector["mm_input_projection_weight"].t().contiguous(),
        }
    except KeyError as missing:
        raise ModelLoadError(f"the Gemma 3 checkpoint lacks {missing.args[0]}") from None
