"""ir/gguf_blocks.QuantizedTensor: blocks made when read (a function) give what the same blocks held in
memory give, through rows, columns and dequantizing."""

from __future__ import annotations

import numpy as np

from kiln.ir.gguf_blocks import QuantizedTensor


def test_blocks_made_when_read_slice_and_dequantize_as_held_ones() -> None:
    blocks = np.random.default_rng(0).integers(0, 255, (6, 36), dtype=np.uint8)  # two Q4_0 blocks a row
    for scale_at, scale in ((0, 0.5), (18, 0.25)):
        blocks[:, scale_at : scale_at + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
    made: list[int] = []

    def make() -> np.ndarray:
        made.append(1)
        return blocks.copy()

    held = QuantizedTensor("Q4_0", (6, 64), blocks)
    lazy = QuantizedTensor("Q4_0", (6, 64), make, origin="test")
    assert not made  # nothing is made until read
    for part in (
        lambda t: t,
        lambda t: t.rows(1, 4),
        lambda t: t.columns(32, 64),
        lambda t: t.rows(2, 5).columns(0, 32),
    ):
        assert np.array_equal(part(lazy).read(), part(held).read())
        assert np.array_equal(part(lazy).dequantize().numpy(), part(held).dequantize().numpy())
        assert part(lazy).origin == "test"
