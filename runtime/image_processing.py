"""An image into the pixel values a vision encoder takes, as the model's HF image processor makes them
(read from its preprocessor_config.json), value for value.

The steps and their arithmetic follow transformers' PIL image processors (CLIPImageProcessor for
LLaVA-1.5, SiglipImageProcessor, Gemma3ImageProcessor): transparency composited onto white, a Pillow
resize of the uint8 image (to a fixed size, or the shortest edge to `shortest_edge` keeping the aspect
ratio, lengths truncated), a center crop, x `rescale_factor` in float64 then float32, and
(x - mean) / std in float32. The result is [3, height, width] float32.

Idefics3 (SmolVLM) splits instead (`TiledImageProcessing`): the longest edge resized to
`size.longest_edge`, then both edges up to multiples of the tile, cut into rows x cols tiles, plus the
whole image resized to one tile (the global image), each tile rescaled and normalized as above; its
prompt text for the image names each tile (`idefics3_image_text`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from PIL import Image

PixelValues = npt.NDArray[np.float32]  # [3, height, width]

PROCESSORS = ("CLIPImageProcessor", "SiglipImageProcessor", "Gemma3ImageProcessor")
TILED_PROCESSORS = ("Idefics3ImageProcessor",)
MAX_IMAGE_SIZE = 4096  # Idefics3's bound on either edge after the first resize


class ImageProcessingError(ValueError):
    """A preprocessor_config.json this module cannot follow."""


@dataclass(frozen=True)
class ImageProcessing:
    """One model's image preprocessing (module docstring); `size` and `crop` are (height, width)."""

    size: tuple[int, int] | None  # a fixed resize, or None
    shortest_edge: int | None  # the shortest edge resized to this, aspect kept; or None
    crop: tuple[int, int] | None  # a center crop after the resize, or None
    resample: int  # Pillow's filter number (2 bilinear, 3 bicubic)
    rescale_factor: float | None
    mean: tuple[float, ...] | None  # None: no normalization
    std: tuple[float, ...] | None
    convert_rgb: bool = True

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ImageProcessing:
        """From a preprocessor_config.json as transformers saves it (every field written out)."""
        kind = config.get("image_processor_type", "").removesuffix("Fast").removesuffix("Pil")
        if kind not in PROCESSORS:
            raise ImageProcessingError(
                f"image_processor_type {config.get('image_processor_type')!r} is not supported "
                f"(supported: {', '.join(PROCESSORS)})"
            )
        if config.get("do_pan_and_scan"):
            raise ImageProcessingError("Gemma 3's do_pan_and_scan is not supported; set it to false")
        size = config.get("size") or {}
        fixed = shortest = None
        if config.get("do_resize", True):
            if isinstance(size, int):  # an old config's one number
                square = {"height": size, "width": size}
                size = {"shortest_edge": size} if kind == "CLIPImageProcessor" else square
            if "height" in size and "width" in size:
                fixed = (int(size["height"]), int(size["width"]))
            elif "shortest_edge" in size:
                shortest = int(size["shortest_edge"])
            else:
                raise ImageProcessingError(f"size {size!r}: expected height and width, or shortest_edge")
        crop = None
        if config.get("do_center_crop", False):
            crop_size = config.get("crop_size") or {}
            if isinstance(crop_size, int):
                crop_size = {"height": crop_size, "width": crop_size}
            crop = (int(crop_size["height"]), int(crop_size["width"]))
        normalize = config.get("do_normalize", True)
        rescale = config.get("do_rescale", True)
        return cls(
            size=fixed,
            shortest_edge=shortest,
            crop=crop,
            resample=int(config.get("resample", 3)),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)) if rescale else None,
            mean=tuple(config["image_mean"]) if normalize else None,
            std=tuple(config["image_std"]) if normalize else None,
            convert_rgb=bool(config.get("do_convert_rgb", True)),
        )

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every image's pixel values, where that does not depend on the image."""
        return self.crop or self.size

    def pixel_values(self, image: Image.Image) -> PixelValues:
        rgb = to_rgb(image) if self.convert_rgb else image
        resized = rgb.resize(self._resized_size(rgb.height, rgb.width)[::-1], resample=self.resample)
        pixels = np.asarray(resized)
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        if self.crop is not None:
            pixels = _center_crop(pixels, self.crop)
        values: npt.NDArray[Any] = pixels
        if self.rescale_factor is not None:
            values = (values.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.mean is not None and self.std is not None:
            values = values.astype(np.float32, copy=False)
            values = (values - np.array(self.mean, np.float32)) / np.array(self.std, np.float32)
        return np.ascontiguousarray(values.transpose(2, 0, 1), dtype=np.float32)

    def _resized_size(self, height: int, width: int) -> tuple[int, int]:
        if self.size is not None:
            return self.size
        if self.shortest_edge is None:
            return height, width
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(self.shortest_edge * long / short)
        return (new_long, self.shortest_edge) if width <= height else (self.shortest_edge, new_long)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, any transparency composited onto white (as transformers' convert_to_rgb)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _center_crop(pixels: npt.NDArray[np.uint8], crop: tuple[int, int]) -> npt.NDArray[np.uint8]:
    """[H, W, C] cut to `crop` about the center, zero-padded (centered) where the image is smaller."""
    height, width = pixels.shape[:2]
    crop_height, crop_width = crop
    padded_height, padded_width = max(height, crop_height), max(width, crop_width)
    if (padded_height, padded_width) != (height, width):
        canvas = np.zeros((padded_height, padded_width, pixels.shape[2]), dtype=pixels.dtype)
        top, left = -(-(padded_height - height) // 2), -(-(padded_width - width) // 2)
        canvas[top : top + height, left : left + width] = pixels
        pixels = canvas
    top = (padded_height - crop_height) // 2
    left = (padded_width - crop_width) // 2
    return pixels[top : top + crop_height, left : left + crop_width]


@dataclass(frozen=True)
class TiledImageProcessing:
    """Idefics3's preprocessing (module docstring): tiles of `tile` x `tile` pixels."""

    longest_edge: int
    tile: int
    splitting: bool
    resample: int
    rescale_factor: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TiledImageProcessing:
        kind = config.get("image_processor_type", "").removesuffix("Fast").removesuffix("Pil")
        if kind not in TILED_PROCESSORS:
            kind = config.get("image_processor_type")
            raise ImageProcessingError(f"image_processor_type {kind!r} is not a tiled one")
        return cls(
            longest_edge=int((config.get("size") or {}).get("longest_edge", 4 * 364)),
            tile=int((config.get("max_image_size") or {}).get("longest_edge", 364)),
            splitting=bool(config.get("do_image_splitting", True)),
            resample=int(config.get("resample", 1)),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)),
            mean=tuple(config.get("image_mean", (0.5, 0.5, 0.5))),
            std=tuple(config.get("image_std", (0.5, 0.5, 0.5))),
        )

    def tiles(self, image: Image.Image) -> tuple[list[PixelValues], int, int]:
        """(the tiles in row-major order then the global image, rows, cols); without splitting, or for an
        image within one tile, the global image alone and rows = cols = 0."""
        rgb = to_rgb(image)
        height, width = _longest_edge_size(rgb.height, rgb.width, self.longest_edge)
        resized = rgb.resize((width, height), resample=self.resample)
        if not self.splitting:
            return [self._values(resized.resize((self.tile, self.tile), resample=self.resample))], 0, 0
        height, width = _tile_multiple_size(height, width, self.tile)
        resized = resized.resize((width, height), resample=self.resample)
        if height <= self.tile and width <= self.tile:
            return [self._values(resized)], 0, 0
        rows, cols = height // self.tile, width // self.tile
        pixels = np.asarray(resized)
        tiles = [
            self._values(pixels[r * self.tile : (r + 1) * self.tile, c * self.tile : (c + 1) * self.tile])
            for r in range(rows)
            for c in range(cols)
        ]
        tiles.append(self._values(resized.resize((self.tile, self.tile), resample=self.resample)))
        return tiles, rows, cols

    def _values(self, image: Image.Image | npt.NDArray[np.uint8]) -> PixelValues:
        pixels = (np.asarray(image).astype(np.float64) * self.rescale_factor).astype(np.float32)
        values = (pixels - np.array(self.mean, np.float32)) / np.array(self.std, np.float32)
        return np.ascontiguousarray(values.transpose(2, 0, 1), dtype=np.float32)


def _longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """The longest edge to `longest` (the other truncated, rounded up to even), then both within
    MAX_IMAGE_SIZE, as Idefics3's processor computes them."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Both edges up to multiples of `tile`, the aspect kept as Idefics3's processor keeps it."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def idefics3_image_text(rows: int, cols: int, image_seq_len: int, image_token: str = "<image>") -> str:
    """The prompt text that stands for one image of `rows` x `cols` tiles (Idefics3's processor's)."""
    fake, global_tag = "<fake_token_around_image>", "<global-img>"
    if rows == 0 and cols == 0:
        return fake + global_tag + image_token * image_seq_len + fake
    text = ""
    for row in range(rows):
        for col in range(cols):
            text += fake + f"<row_{row + 1}_col_{col + 1}>" + image_token * image_seq_len
        text += "\n"
    return text + "\n" + fake + global_tag + image_token * image_seq_len + fake


def processing_of(config: dict[str, Any]) -> ImageProcessing | TiledImageProcessing:
    """The preprocessing a preprocessor_config.json describes: tiled (Idefics3's) or not."""
    kind = str(config.get("image_processor_type", "")).removesuffix("Fast").removesuffix("Pil")
    if kind in TILED_PROCESSORS:
        return TiledImageProcessing.from_config(config)
    return ImageProcessing.from_config(config)
