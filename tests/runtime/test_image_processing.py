"""Kiln's image preprocessing against transformers' PIL image processors: the same float32 values, bit
for bit, for images of several sizes, aspect ratios and modes."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from kiln.runtime.image_processing import (
    ImageProcessing,
    ImageProcessingError,
    TiledImageProcessing,
    idefics3_image_text,
)

transformers = pytest.importorskip("transformers")


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(0)

    def noise(height: int, width: int, channels: int) -> np.ndarray:
        return rng.integers(0, 256, (height, width, channels), dtype=np.uint8)

    rgba = Image.fromarray(noise(50, 70, 4), "RGBA")
    palette = Image.fromarray(noise(40, 40, 3), "RGB").convert("P")
    palette.info["transparency"] = 0
    return [
        Image.fromarray(noise(480, 640, 3), "RGB"),  # landscape, larger than every target
        Image.fromarray(noise(333, 200, 3), "RGB"),  # portrait, odd sizes
        Image.fromarray(noise(17, 300, 3), "RGB"),  # thinner than the crop after resizing
        Image.fromarray(noise(90, 90, 1)[:, :, 0], "L"),  # grayscale
        rgba,  # transparency onto white
        palette,  # a palette with a transparent index
    ]


def _processors():
    from transformers import CLIPImageProcessorPil, Gemma3ImageProcessorPil, SiglipImageProcessorPil

    return [
        CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}),
        CLIPImageProcessorPil(),  # 224
        SiglipImageProcessorPil(size={"height": 384, "width": 384}),
        Gemma3ImageProcessorPil(size={"height": 896, "width": 896}),
    ]


@pytest.mark.parametrize("processor", _processors(), ids=lambda p: type(p).__name__)
def test_pixel_values_equal_transformers(processor) -> None:
    processing = ImageProcessing.from_config(processor.to_dict())
    for image in _images():
        expected = processor(images=image, return_tensors="np")["pixel_values"][0]
        actual = processing.pixel_values(image)
        assert actual.dtype == np.float32 and actual.shape == expected.shape
        assert np.array_equal(actual, expected), f"{image.mode} {image.size}"
        if processing.output_size is not None:
            assert actual.shape[1:] == processing.output_size


def test_an_unsupported_processor_is_named() -> None:
    with pytest.raises(ImageProcessingError, match="Idefics3ImageProcessor"):  # a tiled one
        ImageProcessing.from_config({"image_processor_type": "Idefics3ImageProcessor"})
    with pytest.raises(ImageProcessingError, match="pan_and_scan"):
        ImageProcessing.from_config(
            {"image_processor_type": "Gemma3ImageProcessor", "do_pan_and_scan": True, "image_mean": [0.5] * 3}
        )


@pytest.mark.parametrize("splitting", [True, False])
def test_idefics3_tiles_equal_transformers(splitting: bool) -> None:
    from transformers import Idefics3ImageProcessorPil

    processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 96}, max_image_size={"longest_edge": 32}, do_image_splitting=splitting
    )
    processing = TiledImageProcessing.from_config(processor.to_dict())
    rng = np.random.default_rng(1)
    sizes = [(480, 640), (333, 200), (20, 30), (50, 700), (96, 96)]
    for height, width in sizes:
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
        expected = processor(images=[image], return_tensors="np", return_row_col_info=True)
        tiles, rows, cols = processing.tiles(image)
        assert (rows, cols) == (expected["rows"][0][0], expected["cols"][0][0]), (height, width)
        frames = expected["pixel_values"][0]
        assert len(tiles) == len(frames)
        for tile, frame in zip(tiles, frames, strict=True):
            assert np.array_equal(tile, frame), (height, width)


def test_idefics3_image_text_equals_the_processor_s() -> None:
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    class Names:  # the processor reads only these of its tokenizer here
        image_token = "<image>"
        fake_image_token = "<fake_token_around_image>"
        global_image_tag = "<global-img>"

    for rows, cols in ((0, 0), (2, 3)):
        names = Names()
        names.image_seq_len = 4  # type: ignore[attr-defined]
        expected = Idefics3Processor.replace_image_token(names, {"rows": [[rows]], "cols": [[cols]]}, 0)  # type: ignore[arg-type]
        assert idefics3_image_text(rows, cols, 4) == expected
