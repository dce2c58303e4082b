"""The artifact's weights file: written a tensor at a time, 64-byte aligned, read back as mapped views."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kiln.ir.host_arrays import as_torch
from kiln.runtime.weights_file import (
    ALIGNMENT,
    Entry,
    WeightsFileError,
    read_weights_file,
    write_weights_file,
)

TENSORS = {
    "a": torch.randn(3, 5),
    "b": torch.arange(7, dtype=torch.int8),
    "c": torch.randn(64, 33).bfloat16(),
    "d": torch.randn(2, 2, 2).half(),
    "empty": torch.zeros(0),
}


def _entries(tensors: dict[str, torch.Tensor]) -> list[Entry]:
    return [Entry(name, t.dtype, tuple(t.shape), lambda t=t: t) for name, t in tensors.items()]


def test_round_trip_aligned_and_readable_by_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    write_weights_file(path, _entries(TENSORS))
    mapped = read_weights_file(path)
    assert set(mapped) == set(TENSORS)
    for name, tensor in TENSORS.items():
        assert isinstance(mapped[name], np.ndarray), name
        shared = as_torch(mapped[name])
        assert shared.dtype == tensor.dtype and torch.equal(shared, tensor), name
        assert tensor.numel() == 0 or mapped[name].ctypes.data % ALIGNMENT == 0, name
    theirs = load_file(str(path))  # the format is plain safetensors (the padding shows as __pad.N)
    assert all(torch.equal(theirs[name], tensor) for name, tensor in TENSORS.items())


def test_the_digest_is_the_files_sha256(tmp_path: Path) -> None:
    import hashlib

    path = tmp_path / "w.safetensors"
    assert write_weights_file(path, _entries(TENSORS)) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_tensor_made_otherwise_than_declared_is_refused(tmp_path: Path) -> None:
    entry = Entry("x", torch.float32, (2,), lambda: torch.zeros(3))
    with pytest.raises(WeightsFileError, match=r"x was declared torch.float32 \[2\] and made"):
        write_weights_file(tmp_path / "w.safetensors", [entry])


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    write_weights_file(path, _entries(TENSORS))
    os.truncate(path, path.stat().st_size - ALIGNMENT * 2)
    with pytest.raises(WeightsFileError, match="does not fit the file"):
        read_weights_file(path)
