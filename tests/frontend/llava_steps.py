"""LLaVA's step with image rows checked against transformers, on any executable (the reference and
ONNX Runtime in test_llava.py, TVM on the compiled artifact in tests/compiler/test_codegen_vision.py)."""

from __future__ import annotations

from typing import Any

import torch

from kiln.frontend.models.clip_vision import encoder_inputs
from kiln.ir.interpreter import interpret
from kiln.ir.step import SequenceSlice, build_step_inputs


def check_image_rows_in_the_step(
    executable: Any, reference: Any, vision: Any, encoder: Any, vocab_size: int
) -> None:
    """The step with image rows (ir/step.py IMAGE_ROWS_INPUT) fed by the captured `encoder`: LLaVA's
    logits for a prompt with an image, the image's tokens cut across two chunked-prefill steps, then a
    step without an image, each within 1e-4 of `reference` (transformers)."""
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(7))
    (rows,) = interpret(encoder.graph, encoder.weights, encoder_inputs(pixels[0].numpy(), vision.patch_size))
    image = rows[1 : vision.num_rows].numpy()  # the default strategy drops the class token's row
    tokens = [5, 6, 7, *[299] * vision.num_image_tokens, 8, 9]
    image_at = list(range(3, 3 + vision.num_image_tokens))
    cut = 10  # the first step ends inside the image
    cache = executable.kv_cache_spec.allocate(3, 16)  # 64-byte aligned, as TVM's kernels want
    logits = []
    for start, end in ((0, cut), (cut, len(tokens))):
        at = [p - start for p in image_at if start <= p < end]
        taken = [i for i, p in enumerate(image_at) if start <= p < end]
        piece = SequenceSlice(tokens[start:end], start, [1, 2], range(end - start), at, image[taken])
        inputs = build_step_inputs([piece], 16, vocab_size=vocab_size)
        logits.append(torch.from_numpy(executable.step(inputs, cache)))
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor([tokens]), pixel_values=pixels).logits[0]
    got = torch.cat(logits)
    assert torch.allclose(got, expected, atol=1e-4, rtol=0), float((got - expected).abs().max())
    after = build_step_inputs([SequenceSlice([10], len(tokens), [1, 2])], 16, vocab_size=vocab_size)
    with torch.no_grad():
        expected_next = reference(input_ids=torch.tensor([[*tokens, 10]]), pixel_values=pixels).logits[0, -1]
    next_logits = torch.from_numpy(executable.step(after, cache))[0]  # no image rows in this step
    assert torch.allclose(next_logits, expected_next, atol=1e-4, rtol=0)
