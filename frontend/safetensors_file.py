"""A safetensors file mapped, not read: each tensor a `Deferred` that copies its bytes out of the mapping
when it is materialized and then drops the mapping's pages (ir/mapped.py), so a compile holds one
tensor of a checkpoint at a time, as it does a GGUF's.

The format: an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
byte range in the data that follows.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import torch

from kiln.errors import ModelLoadError
from kiln.ir.deferred import Deferred
from kiln.ir.mapped import let_go

# safetensors dtype → (the numpy dtype its bytes are read as, the torch dtype they are viewed as)
DTYPES: dict[str, tuple[np.dtype, torch.dtype]] = {
    "F64": (np.dtype(np.float64), torch.float64),
    "F32": (np.dtype(np.float32), torch.float32),
    "F16": (np.dtype(np.float16), torch.float16),
    "BF16": (np.dtype(np.int16), torch.bfloat16),
    "F8_E4M3": (np.dtype(np.uint8), torch.float8_e4m3fn),
    "F8_E5M2": (np.dtype(np.uint8), torch.float8_e5m2),
    "I64": (np.dtype(np.int64), torch.int64),
    "I32": (np.dtype(np.int32), torch.int32),
    "I16": (np.dtype(np.int16), torch.int16),
    "I8": (np.dtype(np.int8), torch.int8),
    "U8": (np.dtype(np.uint8), torch.uint8),
    "BOOL": (np.dtype(np.bool_), torch.bool),
}
MAX_HEADER_BYTES = 100 * 1024 * 1024


def mapped_tensors(file: Path) -> dict[str, Deferred]:
    """Every tensor of `file`, deferred: its header is read now, its data when a tensor is asked for."""
    header, data_start = _read_header(file)
    size = file.stat().st_size
    mapping = np.memmap(file, dtype=np.uint8, mode="r") if size > data_start else np.zeros(0, np.uint8)
    tensors: dict[str, Deferred] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            kind, shape, (begin, end) = (
                entry["dtype"],
                tuple(int(n) for n in entry["shape"]),
                entry["data_offsets"],
            )
        except (KeyError, TypeError, ValueError):
            raise _corrupt(file, f"tensor {name!r} has a malformed header entry") from None
        if kind not in DTYPES:
            raise ModelLoadError(
                f"{file}: tensor {name!r} has dtype {kind}, which Kiln cannot read",
                hint=f"Kiln reads safetensors of {', '.join(DTYPES)}",
            )
        numpy_dtype, torch_dtype = DTYPES[kind]
        if end - begin != math.prod(shape) * numpy_dtype.itemsize or begin < 0 or data_start + end > size:
            raise _corrupt(file, f"tensor {name!r} does not fit its byte range {begin}..{end}")
        tensors[name] = Deferred(
            shape,
            torch_dtype,
            _reader(mapping, data_start + begin, data_start + end, numpy_dtype, torch_dtype, shape),
        )
    return tensors


def _reader(
    mapping: np.ndarray,
    begin: int,
    end: int,
    numpy_dtype: np.dtype,
    torch_dtype: torch.dtype,
    shape: tuple[int, ...],
):
    def read() -> torch.Tensor:
        view = mapping[begin:end]
        values = np.array(view).view(numpy_dtype)
        let_go(view)
        return torch.from_numpy(values).view(torch_dtype).reshape(shape)

    return read


def _read_header(file: Path) -> tuple[dict, int]:
    try:
        with file.open("rb") as stream:
            prefix = stream.read(8)
            if len(prefix) < 8:
                raise _corrupt(file, "shorter than its header")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES:
                raise _corrupt(file, f"header length {length} is implausible")
            text = stream.read(length)
    except OSError as error:
        raise ModelLoadError(f"{file}: cannot read ({error})", hint="check the file's permissions") from None
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _corrupt(file, "the header is not JSON") from None
    if len(text) < length or not isinstance(header, dict):
        raise _corrupt(file, "the header is truncated")
    return header, 8 + length


def _corrupt(file: Path, what: str) -> ModelLoadError:
    return ModelLoadError(
        f"{file}: cannot read safetensors ({what})",
        hint="the file is truncated or corrupt; download it again",
    )
