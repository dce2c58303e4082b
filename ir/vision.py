"""The image encoder's contract (a vision-language model's second entry point, `encode_image`): what
an artifact's manifest says of it (`VisionSpec`, its `vision` object) and how one image's pixel values
become the encoder's inputs, shared by the frontend that captures the encoder and the runtime that
feeds it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

INPUT_KINDS = ("clip", "siglip")  # a class-token row then the patches (clip_encoder_inputs); the patches


@dataclass(frozen=True)
class VisionSpec:
    """What the runtime needs besides the compiled encoder (an artifact manifest's `vision` object).

    `inputs`: how an image's pixel values become the encoder's inputs ("clip": a class-token row, then
    the patches: `clip_encoder_inputs`); `first_row`: the encoder's output rows before the image's own
    (the class token's, which LLaVA's default strategy drops); `num_image_tokens`: the rows an image takes
    in the prompt, each at one `image_token_id`. A prompt marks an image with `image_token` once (or with
    `prompt_token` where the family's differs, Gemma 3's `<start_of_image>`), which becomes the image's
    placeholder text (`image_text` where the family has a fixed one; else the image token a row).
    `bidirectional`: an image's tokens attend to one another both ways (ir/step.py visible_ends)."""

    family: str
    inputs: str
    preprocessor: dict[str, Any]  # the model's preprocessor_config.json
    image_token: str
    image_token_id: int
    num_image_tokens: int
    first_row: int
    patch_size: int
    hidden_size: int  # the text model's: each row's width
    prompt_token: str | None = None
    prompt_token_id: int | None = None
    image_text: str | None = None
    bidirectional: bool = False

    @property
    def placeholder_text(self) -> str:
        """What a prompt holds once where an image goes."""
        return self.prompt_token or self.image_token

    @property
    def placeholder_id(self) -> int:
        return self.image_token_id if self.prompt_token_id is None else self.prompt_token_id

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VisionSpec:
        return cls(**data)


def clip_encoder_inputs(
    pixel_values: npt.NDArray[np.float32], patch_size: int, row_block: int = 1
) -> dict[str, npt.NDArray[Any]]:
    """The CLIP encoder's inputs for one image's [3, H, W] pixel values: `patches` [rows, 3 * p * p], a
    zero row (the class token's) then each patch in raster order, flattened as the convolution's weight is
    (channel, row, column); `position_ids` [rows]; `num_rows` [1]. Rows are padded with zeros (position
    0) to a multiple of `row_block`."""
    flat = flat_patches(pixel_values, patch_size)
    real = flat.shape[0] + 1
    rows = -(-real // row_block) * row_block
    patches = np.zeros((rows, flat.shape[1]), np.float32)
    patches[1:real] = flat
    position_ids = np.zeros(rows, np.int64)
    position_ids[:real] = np.arange(real)
    return {"patches": patches, "position_ids": position_ids, "num_rows": np.array([real], np.int64)}


def flat_patches(pixel_values: npt.NDArray[np.float32], patch_size: int) -> npt.NDArray[np.float32]:
    """[3, H, W] as [patches, 3 * p * p]: raster order, each patch flattened as a patch-embedding
    convolution's weight is (channel, row, column)."""
    channels, height, width = pixel_values.shape
    grid_h, grid_w = height // patch_size, width // patch_size
    blocks = pixel_values.reshape(channels, grid_h, patch_size, grid_w, patch_size)
    flat = blocks.transpose(1, 3, 0, 2, 4).reshape(grid_h * grid_w, channels * patch_size * patch_size)
    return np.ascontiguousarray(flat, dtype=np.float32)
