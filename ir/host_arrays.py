"""Host tensors between numpy (what a serving process holds: mapped weights, step inputs, logits) and
torch (what the compiler and the torch-based backends compute with), shared, never copied. numpy lacks
bfloat16 and float8: those are ml_dtypes' types on the numpy side, reinterpreted bit for bit."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    import torch

# numpy dtypes torch.from_numpy does not know, with the same-width integer to pass their bits through
_BITS_OF = {
    np.dtype(ml_dtypes.bfloat16): (np.int16, "bfloat16"),
    np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, "float8_e4m3fn"),
    np.dtype(ml_dtypes.float8_e5m2): (np.uint8, "float8_e5m2"),
}


def as_torch(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor sharing `array`'s memory."""
    import torch

    bits = _BITS_OF.get(array.dtype)
    if bits is None:
        return torch.from_numpy(array)
    integer, name = bits
    return torch.from_numpy(array.view(integer)).view(getattr(torch, name))


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array sharing a CPU tensor's memory."""
    import torch

    for dtype, (integer, name) in _BITS_OF.items():
        if tensor.dtype == getattr(torch, name):
            bits = torch.from_numpy(np.empty(0, integer)).dtype
            return tensor.detach().view(bits).numpy().view(dtype)
    return tensor.detach().numpy()


def torch_weights(weights: Mapping[str, Any]) -> dict[str, Any]:
    """`weights` with its numpy arrays (an artifact's mapped file) as tensors sharing their memory, for a
    backend that computes with torch; tensors and deferred weights (a program's) as they are."""
    return {name: as_torch(w) if isinstance(w, np.ndarray) else w for name, w in weights.items()}


def exportable(array: np.ndarray) -> tuple[np.ndarray, str | None]:
    """`array` as numpy can hand it over by DLPack, and the dtype to view that as where it differs
    (bfloat16 and float8 travel as same-width integers)."""
    bits = _BITS_OF.get(array.dtype)
    return (array, None) if bits is None else (array.view(bits[0]), bits[1])


HOST_DTYPES: dict[str, Any] = {  # IR dtype name -> numpy dtype of a host array holding it
    "f32": np.float32,
    "f16": np.float16,
    "bf16": ml_dtypes.bfloat16,
    "f8e4m3": ml_dtypes.float8_e4m3fn,
    "i64": np.int64,
    "i32": np.int32,
    "u8": np.uint8,
    "i8": np.int8,
    "bool": np.bool_,
}
_IR_NAME_OF_HOST = {np.dtype(dtype): name for name, dtype in HOST_DTYPES.items()}


def ir_dtype_of(array: Any) -> str:
    """The IR dtype name of a numpy array's or a torch tensor's elements."""
    if isinstance(array, np.ndarray):
        return _IR_NAME_OF_HOST[array.dtype]
    from kiln.ir.types import DTYPE_OF_TORCH

    return DTYPE_OF_TORCH[array.dtype]


def device_of(array: Any) -> str:
    """ "cpu" for a numpy array, else the torch tensor's device type ("cpu", "cuda", "meta")."""
    return "cpu" if isinstance(array, np.ndarray) else str(array.device.type)
