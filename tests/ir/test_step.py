"""The step contract's flat tensors (ir/step.py): visible_ends for a model whose images attend both
ways."""

from __future__ import annotations

import numpy as np

from kiln.ir.step import SequenceSlice, build_step_inputs


def test_an_image_tokens_see_to_the_end_of_their_image_and_text_tokens_to_themselves() -> None:
    rows = np.zeros((5, 2), np.float32)
    first = SequenceSlice([1, 9, 9, 9, 2, 9, 9], 4, [0, 1], image_at=[1, 2, 3, 5, 6], image_rows=rows)
    second = SequenceSlice([3], 7, [2])
    inputs = build_step_inputs([first, second], 8, vocab_size=10, bidirectional_images=True)
    assert inputs.visible_ends is not None
    assert inputs.visible_ends.tolist() == [5, 8, 8, 8, 9, 11, 11, 8]
    assert build_step_inputs([second], 8).visible_ends is None
