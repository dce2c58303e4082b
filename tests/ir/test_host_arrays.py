"""Host arrays between numpy and torch share memory, bfloat16 and float8 included (ml_dtypes' types on
the numpy side), and name their IR dtype."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from kiln.ir.host_arrays import HOST_DTYPES, as_numpy, as_torch, device_of, exportable, ir_dtype_of
from kiln.ir.types import DTYPES

FLOATS = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f8e4m3": torch.float8_e4m3fn}


@pytest.mark.parametrize("name", sorted(FLOATS))
def test_a_tensor_and_its_array_share_memory_and_values(name: str) -> None:
    tensor = torch.linspace(-3, 3, 24).reshape(4, 6).to(FLOATS[name])
    array = as_numpy(tensor)
    assert array.dtype == np.dtype(HOST_DTYPES[name]) and array.shape == (4, 6)
    assert array.ctypes.data == tensor.data_ptr()
    assert np.array_equal(array.astype(np.float32), tensor.float().numpy())
    back = as_torch(array)
    assert back.dtype == tensor.dtype and back.data_ptr() == tensor.data_ptr() and torch.equal(back, tensor)
    array[0, 0] = array[0, 1]  # writes through to the tensor
    assert tensor[0, 0] == tensor[0, 1]
    assert ir_dtype_of(array) == ir_dtype_of(tensor) == name and DTYPES[name] == tensor.dtype


def test_what_numpy_cannot_hand_over_by_dlpack_travels_as_same_width_integers() -> None:
    plain = np.zeros(3, np.float16)
    assert exportable(plain) == (plain, None)
    bits, view_as = exportable(np.zeros(3, ml_dtypes.bfloat16))
    assert bits.dtype == np.int16 and view_as == "bfloat16"
    bits, view_as = exportable(np.zeros(3, ml_dtypes.float8_e4m3fn))
    assert bits.dtype == np.uint8 and view_as == "float8_e4m3fn"


def test_device_of() -> None:
    assert device_of(np.zeros(2)) == "cpu" == device_of(torch.zeros(2))
    assert device_of(torch.zeros(2, device="meta")) == "meta"
