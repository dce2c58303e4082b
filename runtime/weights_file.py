"""An artifact's weights file: safetensors, written one tensor at a time and mapped when read.

Writing takes each tensor's name, dtype and shape first (the header), then makes and writes the tensors
one by one, so memory holds one tensor however large the model. Every tensor starts on a 64-byte
boundary (the header is padded with spaces, as safetensors allows, and `__pad.N` byte tensors fill
the gaps), so the compiled kernels' aligned loads can read it where it is mapped. Reading maps the file
read-only-in-effect (copy-on-write, never written): the tensors are views of the page cache, shared by
every process that serves the same artifact, and nothing is read until a kernel touches it. Read
tensors are numpy arrays (bfloat16 and float8 as ml_dtypes' types), so a serving process needs no torch;
writing takes torch tensors (the compiler's).
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    import torch

ALIGNMENT = 64
PAD_PREFIX = "__pad."
# safetensors' dtype names: numpy's (ml_dtypes' for the float formats numpy lacks), torch's by name
_NUMPY_DTYPES: dict[str, Any] = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F64": np.float64,
    "I8": np.int8,
    "U8": np.uint8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}
_TORCH_NAMES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I8": "int8",
    "U8": "uint8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def _name_of(dtype: torch.dtype) -> str:
    import torch

    names = {getattr(torch, torch_name): name for name, torch_name in _TORCH_NAMES.items()}
    if dtype not in names:
        raise WeightsFileError(f"a weights file cannot hold {dtype}")
    return names[dtype]


class WeightsFileError(ValueError):
    """A weights file that is not the safetensors this module writes and reads."""


@dataclass(frozen=True)
class Entry:
    """A tensor to write: its name, dtype and shape now, its values from `make()` when written."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _header(entries: list[Entry]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt", "alignment": str(ALIGNMENT)}}
    offset = 0
    for index, entry in enumerate(entries):
        header[entry.name] = {
            "dtype": _name_of(entry.dtype),
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
        pad = -offset % ALIGNMENT
        if pad:
            header[f"{PAD_PREFIX}{index}"] = {
                "dtype": "U8",
                "shape": [pad],
                "data_offsets": [offset, offset + pad],
            }
            offset += pad
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-(8 + len(text)) % ALIGNMENT)


def write_weights_file(path: Path, entries: Iterable[Entry]) -> str:
    """Write `entries` to `path` in order, one tensor in memory at a time; their sha256 (of the file)."""
    import torch

    entries = list(entries)
    names = [entry.name for entry in entries]
    if len(set(names)) != len(names) or any(name.startswith(PAD_PREFIX) for name in names):
        raise WeightsFileError(f"{path}: tensor names repeat or start with {PAD_PREFIX!r}")
    header = _header(entries)
    digest = hashlib.sha256()
    with path.open("wb") as file:

        def put(data: bytes | memoryview) -> None:
            file.write(data)
            digest.update(data)

        put(struct.pack("<Q", len(header)))
        put(header)
        for entry in entries:
            tensor = entry.make()
            if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
                raise WeightsFileError(
                    f"{path}: {entry.name} was declared {entry.dtype} {list(entry.shape)} and made "
                    f"{tensor.dtype} {list(tensor.shape)}"
                )
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            put(memoryview(raw))
            del tensor, raw
            pad = -entry.nbytes % ALIGNMENT
            if pad:
                put(bytes(pad))
    return digest.hexdigest()


def read_weights_file(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file, as numpy views of it mapped copy-on-write (nothing read yet)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            (header_size,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(header_size))
            mapped = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY) if size else None
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise WeightsFileError(f"{path}: cannot read a safetensors header ({error})") from None
    start = 8 + header_size
    if not isinstance(header, dict) or start > size:
        raise WeightsFileError(f"{path}: not a safetensors file")
    arrays: dict[str, np.ndarray] = {}
    for name, entry in header.items():
        if name == "__metadata__" or name.startswith(PAD_PREFIX):
            continue
        try:
            dtype = np.dtype(_NUMPY_DTYPES[entry["dtype"]])
            first, last = (int(n) for n in entry["data_offsets"])
            shape = tuple(int(n) for n in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise WeightsFileError(f"{path}: tensor {name!r} has a malformed header entry") from None
        count = math.prod(shape)
        if last - first != count * dtype.itemsize or start + last > size or (start + first) % dtype.itemsize:
            raise WeightsFileError(f"{path}: tensor {name!r} does not fit the file (truncated?)")
        if count:
            assert mapped is not None
            arrays[name] = np.frombuffer(mapped, dtype, count, start + first).reshape(shape)
        else:
            arrays[name] = np.empty(shape, dtype)
    return arrays
