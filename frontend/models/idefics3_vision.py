"""Idefics3's (SmolVLM's) image encoder in plain torch.nn: the SigLIP tower over one image tile, the
pixel shuffle that folds each s x s square of patches into one row of s^2 x width features, and the
connector's projection into the text model's hidden size.

The pixel shuffle is a gather of rows into square order (a constant index, `shuffle`) and a reshape:
output row (h', w') holds patches (h' s + i, w' s + j) for i, then j, as transformers' view/permute
sequence orders them.
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

ARCHITECTURE = "Idefics3ForConditionalGeneration"


@dataclass(frozen=True)
class Idefics3VisionConfig(SiglipConfig):
    scale_factor: int

    @classmethod
    def from_idefics3(cls, config: dict[str, Any]) -> Idefics3VisionConfig:
        """From an Idefics3ForConditionalGeneration config.json."""
        fields = SiglipConfig.fields_of(config, text_width=576)
        made = cls(**fields, scale_factor=int(config.get("scale_factor", 2)))
        if made.grid % made.scale_factor or made.num_tokens % 4 or made.num_rows % 4:
            raise ModelLoadError(
                f"a {made.grid} x {made.grid} patch grid with scale_factor {made.scale_factor}: not supported"
            )
        return made

    @property
    def num_tokens(self) -> int:  # a tile's image tokens
        return self.num_rows // (self.scale_factor * self.scale_factor)


class Idefics3VisionProjector(nn.Module):
    def __init__(self, config: Idefics3VisionConfig) -> None:
        super().__init__()
        self.tower = SiglipTower(config)
        # a constant index, held as a (frozen) parameter so that capture makes it a weight
        self.shuffle = nn.Parameter(shuffle_order(config.grid, config.scale_factor), requires_grad=False)
        self.projection = nn.Linear(
            config.hidden_size * config.scale_factor**2, config.text_hidden_size, bias=False
        )
        self.num_tokens = config.num_tokens

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = torch.index_select(self.tower(patches), 0, self.shuffle)
        return linear(self.projection, x.reshape(self.num_tokens, -1))


def shuffle_order(grid: int, scale: int) -> torch.Tensor:
    """The patch rows in pixel-shuffle order: for each output row (h', w'), its s^2 patches (i, j)."""
    side = grid // scale
    order = [
        (h * scale + i) * grid + (w * scale + j)
        for h in range(side)
        for w in range(side)
        for i in range(scale)
        for j in range(scale)
    ]
    return torch.tensor(order, dtype=torch.int64)


def from_idefics3_weights(
    config: Idefics3VisionConfig, weights: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The encoder's state dict from an Idefics3 checkpoint's tensors."""
    tower: dict[str, torch.Tensor] = {}
    connector: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        short = name.removeprefix("model.")
        if short.startswith("vision_model."):
            tower[short.removeprefix("vision_model.")] = tensor
        elif short.startswith("connector."):
            connector[short.removeprefix("connector.")] = tensor
    if not tower:  # saved under vision_tower. as the other families
        tower, _ = tower_tensors(weights)
    try:
        return siglip_weights(config, tower, "tower.") | {
            "shuffle": shuffle_order(config.grid, config.scale_factor),
            "projection.weight": connector["modality_projection.proj.weight"],
        }
    except KeyError as missing:
        raise ModelLoadError(f"the Idefics3 checkpoint lacks {missing.args[0]}") from None
