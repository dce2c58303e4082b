"""Kiln's image preprocessing against transformers' PIL image processors: the same float32 values, bit
for bit, for images of several sizes, aspect ratios and modes."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from kiln.runtime.image_processing import ImageProcessing, ImageProcessingError

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
    with pytest.raises(ImageProcessingError, match="Idefics3ImageProcessor"):
        ImageProcessing.from_config({"image_processor_type": "Idefics3ImageProcessor"})
    with pytest.raises(ImageProcessingError, match="pan_and_scan"):
        ImageProcessing.from_config(
            {"image_processor_type": "Gemma3ImageProcessor", "do_pan_and_scan": True, "image_mean": [0.5] * 3}
        )
