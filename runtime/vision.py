"""A vision-language model's images at run time: an image → pixel values (image_processing.py) → the
compiled encoder's inputs → its rows, one per placeholder token the image takes in the prompt.

    vision = VisionModel(spec, encoder)        # spec: the manifest's `vision`; encoder: the artifact's
    embedding = vision.embed(image)            # ImageEmbedding: rows [num_image_tokens, hidden], digest
    engine.add_request(id, prompt, params, images=[embedding])

The engine places an embedding's rows at its placeholder tokens (`place_images`); the prefix cache keys
those tokens by the image's digest (the hash of its pixel values), so the same image and prompt reuse
blocks and another image does not.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kiln.ir.vision import INPUT_KINDS, VisionSpec, clip_encoder_inputs, flat_patches
from kiln.runtime.image_processing import TiledImageProcessing, idefics3_image_text, processing_of

if TYPE_CHECKING:
    from PIL import Image

    from kiln.backends.base import ImageEncoder
    from kiln.runtime.tokenizer import Tokenizer

ROW_BLOCK = 4  # the encoder's rows are padded to a multiple of this (TVM computes rows in blocks of 4)


@dataclass(frozen=True)
class ImageEmbedding:
    """One image's rows [num_tokens, hidden] (float32), the sha256 of its pixel values, and the token ids
    that take the place of its one placeholder token in a prompt (holding the image token once a row)."""

    rows: npt.NDArray[np.float32]
    digest: bytes
    placeholder: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.rows.shape[0])


class VisionModel:
    """Images → embeddings with a compiled encoder; any thread may call `embed` (one image at a time).
    `tokenizer`: the model's, for a family whose placeholder text depends on the image (Idefics3's
    tiles)."""

    def __init__(self, spec: VisionSpec, encoder: ImageEncoder, tokenizer: Tokenizer | None = None) -> None:
        if spec.inputs not in INPUT_KINDS:
            raise ValueError(f"encoder inputs {spec.inputs!r} are not one of {INPUT_KINDS}")
        self.spec = spec
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.processing = processing_of(spec.preprocessor)
        self._lock = threading.Lock()

    def pixel_values(self, image: Image.Image) -> list[npt.NDArray[np.float32]]:
        """The pixel values the encoder runs on: the image's, or (a tiled family) each tile's then the
        whole image's."""
        return self._tiles(image)[0]

    def placeholder(self, image: Image.Image) -> tuple[int, ...]:
        """The token ids an image's one placeholder becomes."""
        _, rows, cols = self._tiles(image)
        return self._placeholder(rows, cols)

    def embed(self, image: Image.Image) -> ImageEmbedding:
        tiles, rows, cols = self._tiles(image)
        spec = self.spec
        parts = []
        for pixels in tiles:
            if spec.inputs == "clip":
                inputs = clip_encoder_inputs(pixels, spec.patch_size, ROW_BLOCK)
            else:
                inputs = {"patches": flat_patches(pixels, spec.patch_size)}
            with self._lock:
                encoded = self.encoder.encode(inputs)
            parts.append(encoded[spec.first_row : spec.first_row + spec.num_image_tokens])
        digest = hashlib.sha256()
        for pixels in tiles:
            digest.update(pixels.tobytes())
        image_rows = np.ascontiguousarray(np.concatenate(parts), np.float32)
        return ImageEmbedding(image_rows, digest.digest(), self._placeholder(rows, cols))

    def _tiles(self, image: Image.Image) -> tuple[list[npt.NDArray[np.float32]], int, int]:
        if isinstance(self.processing, TiledImageProcessing):
            return self.processing.tiles(image)
        return [self.processing.pixel_values(image)], 0, 0

    def _placeholder(self, rows: int, cols: int) -> tuple[int, ...]:
        spec = self.spec
        tiled = isinstance(self.processing, TiledImageProcessing)
        if not tiled and spec.image_text is None:
            return (spec.image_token_id,) * spec.num_image_tokens
        if self.tokenizer is None:
            raise ValueError(f"a {spec.family} image's placeholder text needs the model's tokenizer")
        if tiled:
            text = idefics3_image_text(rows, cols, spec.num_image_tokens, spec.image_token)
        else:
            assert spec.image_text is not None
            text = spec.image_text
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))


def place_images(
    token_ids: Sequence[int],
    placeholders: Sequence[Sequence[int]],
    image_token_id: int,
    placeholder_id: int | None = None,
) -> tuple[list[int], npt.NDArray[np.int64]]:
    """The prompt with each image's one placeholder token (`placeholder_id`, by default the image token)
    replaced by its `placeholders` ids (which hold the image token once a row), and the positions of every
    image row in it, in order. The prompt holds either one placeholder per image (as a chat template
    writes it) or every image's ids already; anything else is a ValueError."""
    rows_at = [i for i, token in enumerate(token_ids) if token == image_token_id]
    total = sum(sum(1 for token in ids if token == image_token_id) for ids in placeholders)
    if len(rows_at) == total:
        return list(token_ids), np.asarray(rows_at, np.int64)
    marker = image_token_id if placeholder_id is None else placeholder_id
    at = [i for i, token in enumerate(token_ids) if token == marker]
    if len(at) != len(placeholders) or (marker != image_token_id and rows_at):
        raise ValueError(
            f"the prompt has {len(at)} image placeholder tokens (id {marker}) for "
            f"{len(placeholders)} images; put one placeholder where each image goes (or {total} image "
            f"tokens, id {image_token_id}, in all: each image's)"
        )
    expanded: list[int] = []
    last = 0
    for position, ids in zip(at, placeholders, strict=True):
        expanded += token_ids[last:position]
        expanded += ids
        last = position + 1
    expanded += token_ids[last:]
    positions = [i for i, token in enumerate(expanded) if token == image_token_id]
    return expanded, np.asarray(positions, np.int64)


def cache_key_ids(
    token_ids: Sequence[int], positions: npt.NDArray[np.int64], images: Sequence[ImageEmbedding]
) -> list[int]:
    """The prompt's ids as the prefix cache hashes them: each image row's token replaced by a negative
    number drawn from its image's digest (no token id is negative)."""
    keyed = list(token_ids)
    index = 0
    for image in images:
        key = -1 - int.from_bytes(image.digest[:7], "little")
        for position in positions[index : index + image.num_tokens]:
            keyed[int(position)] = key
        index += image.num_tokens
    return keyed


def template_content(parts: Sequence[str | None], image_token: str, template: str | None) -> str | list[Any]:
    """A message's content parts (a text, or None for an image) as its chat template reads them: OpenAI's
    list of parts ({"type": "image"} / {"type": "text", ...}) where the template handles image parts
    itself; else one text, each image's placeholder on a line of its own first (vLLM's "string" form)."""
    if template is not None and ("'image'" in template or '"image"' in template):
        return [{"type": "image"} if part is None else {"type": "text", "text": part} for part in parts]
    placeholders = [f"{image_token}\n" for part in parts if part is None]
    return "".join(placeholders) + "\n".join(part for part in parts if part is not None)
