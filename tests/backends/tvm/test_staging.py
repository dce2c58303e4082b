"""InputStaging packs a step's inputs into one buffer and hands back views of it (here in host memory;
page-locking and the asynchronous copy need a CUDA build of torch, see test_cuda.py's GPU test)."""

from __future__ import annotations

import torch

from kiln.backends.tvm.staging import ALIGNMENT, InputStaging


def _inputs(rows: int, width: int) -> list[torch.Tensor]:
    return [
        torch.arange(rows, dtype=torch.int64),
        torch.arange(rows, dtype=torch.int32) * 3,
        torch.full((rows // 4 + 1, width), -1, dtype=torch.int64),
        torch.empty(0, dtype=torch.int64),
        torch.tensor([rows, 1], dtype=torch.int64),
        torch.arange(6, dtype=torch.int64).reshape(2, 3).t(),  # not contiguous
    ]


def test_views_hold_the_values_dtypes_and_shapes_at_aligned_addresses() -> None:
    staging = InputStaging("cpu")
    assert staging.pin is False
    inputs = _inputs(9, 3)
    views = staging.upload(inputs)
    for view, tensor in zip(views, inputs, strict=True):
        assert view.dtype == tensor.dtype and view.shape == tensor.shape and torch.equal(view, tensor)
        assert view.data_ptr() % ALIGNMENT == 0 and view.is_contiguous()
        assert view.untyped_storage().data_ptr() == staging.on_device.untyped_storage().data_ptr()


def test_buffers_are_reused_and_grow_for_a_bigger_step() -> None:
    staging = InputStaging("cpu")
    staging.upload(_inputs(4, 1))
    first = staging.on_device.data_ptr()
    small = staging.upload(_inputs(2, 1))
    assert staging.on_device.data_ptr() == first and torch.equal(small[0], torch.arange(2))
    big = _inputs(3000, 64)
    views = staging.upload(big)
    assert staging.on_device.numel() >= sum(t.numel() * t.element_size() for t in big)
    assert all(torch.equal(v, t) for v, t in zip(views, big, strict=True))
