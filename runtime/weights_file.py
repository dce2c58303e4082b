"""An artifact's weights file: safetensors, written one tensor at a time and mapped when read.

Writing takes each tensor's name, dtype and shape first (the header), then makes and writes the tensors
one by one, so memory holds one tensor however large the model. Every tensor starts on a 64-byte
boundary (the header is padded with spaces, as safetensors allows, and `__pad.N` byte tensors fill
the gaps), so the compiled kernels' aligned loads can read it where it is mapped. Reading maps the file
read-only-in-effect (copy-on-write, never written): the tensors are views of the page cache, shared by
every process that serves the same artifact, and nothing is read until a kernel touches it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

ALIGNMENT = 64
PAD_PREFIX = "__pad."
_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


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
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


def _header(entries: list[Entry]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt", "alignment": str(ALIGNMENT)}}
    offset = 0
    for index, entry in enumerate(entries):
        header[entry.name] = {
            "dtype": _DTYPE_NAMES[entry.dtype],
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


def read_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, as views of it mapped copy-on-write (nothing read yet)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            (header_size,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(header_size))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise WeightsFileError(f"{path}: cannot read a safetensors header ({error})") from None
    start = 8 + header_size
    if not isinstance(header, dict) or start > size:
        raise WeightsFileError(f"{path}: not a safetensors file")
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size) if size else None
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__" or name.startswith(PAD_PREFIX):
            continue
        try:
            dtype = _DTYPES[entry["dtype"]]
            first, last = (int(n) for n in entry["data_offsets"])
            shape = [int(n) for n in entry["shape"]]
        except (KeyError, TypeError, ValueError):
            raise WeightsFileError(f"{path}: tensor {name!r} has a malformed header entry") from None
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = torch.Size(shape).numel()
        if last - first != count * itemsize or start + last > size or (start + first) % itemsize:
            raise WeightsFileError(f"{path}: tensor {name!r} does not fit the file (truncated?)")
        tensor = torch.empty(0, dtype=dtype)
        if count:
            assert storage is not None
            tensor.set_(storage, (start + first) // itemsize, shape)  # type: ignore[call-overload]
        tensors[name] = tensor.reshape(shape)
    return tensors
