"""InputStaging packs a step's inputs into one buffer and hands back views of it (here in host memory;
page-locking and the asynchronous copy need a CUDA build of torch, see test_cuda.py's GPU test)."""

from __future__ import annotations

import numpy as np
import torch

from kiln.backends.tvm.staging import ALIGNMENT, InputStaging


def _inputs(rows: int, width: int) -> list[np.ndarray]:
    return [
        np.arange(rows, dtype=np.int64),
        np.arange(rows, dtype=np.int32) * 3,
        np.full((rows // 4 + 1, width), -1, dtype=np.int64),
        np.empty(0, dtype=np.int64),
        np.array([rows, 1], dtype=np.int64),
        np.arange(6, dtype=np.int64).reshape(2, 3).T,  # not contiguous
    ]


def test_views_hold_the_values_dtypes_and_shapes_at_aligned_addresses() -> None:
    staging = InputStaging("cpu")
    assert staging.pin is False
    inputs = _inputs(9, 3)
    views = staging.upload(inputs)
    for view, array in zip(views, inputs, strict=True):
        tensor = torch.from_numpy(np.ascontiguousarray(array))
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
    assert staging.on_device.numel() >= sum(a.nbytes for a in big)
    assert all(np.array_equal(v.numpy(), a) for v, a in zip(views, big, strict=True))
