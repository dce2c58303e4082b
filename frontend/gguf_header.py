"""The tensors of a GGUF file (type and size) from its header alone, skimmed without decoding the
metadata (gguf's reader decodes every key, the tokenizer's 150,000 strings included: seconds for a
model a plan only needs to know is quantized)."""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf

from kiln.errors import ModelLoadError

# kept as blocks (imported by `--quantization gguf`, dequantized with `gguf` for capture)
QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "Q5_0", "Q5_1")

_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.at = 0

    def u32(self) -> int:
        (value,) = struct.unpack_from("<I", self.data, self.at)
        self.at += 4
        return int(value)

    def u64(self) -> int:
        (value,) = struct.unpack_from("<Q", self.data, self.at)
        self.at += 8
        return int(value)

    def skip_string(self) -> None:
        length = self.u64()
        self.at += length

    def string(self) -> str:
        length = self.u64()
        self.at += length
        return bytes(self.data[self.at - length : self.at]).decode("utf-8", errors="replace")

    def skip_value(self, value_type: int) -> None:
        if value_type == _STRING:
            self.skip_string()
        elif value_type == _ARRAY:
            item_type, count = self.u32(), self.u64()
            if item_type in _SCALAR_BYTES:
                self.at += count * _SCALAR_BYTES[item_type]
            else:
                for _ in range(count):
                    self.skip_value(item_type)
        elif value_type in _SCALAR_BYTES:
            self.at += _SCALAR_BYTES[value_type]
        else:
            raise ValueError(f"unknown GGUF value type {value_type}")


@dataclass(frozen=True)
class TensorEntry:
    ggml_type: str  # F32, Q4_K, ...
    num_elements: int
    name: str = ""  # llama.cpp's ("blk.0.attn_q.weight")
    shape: tuple[int, ...] = ()  # in torch order (the file's dimensions reversed)

    @property
    def num_bytes(self) -> int:
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.ggml_type]]
        return self.num_elements // block_size * block_bytes


def gguf_tensor_types(path: Path) -> list[str]:
    """The ggml type name of every tensor in the GGUF file `path` (F32, Q4_K, ...), in file order."""
    return [entry.ggml_type for entry in gguf_tensors(path)]


def bytes_by_type(path: Path) -> dict[str, int]:
    """The bytes the GGUF file `path` holds in tensors of each ggml type, most first."""
    totals: dict[str, int] = {}
    for entry in gguf_tensors(path):
        totals[entry.ggml_type] = totals.get(entry.ggml_type, 0) + entry.num_bytes
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def gguf_tensors(path: Path) -> list[TensorEntry]:
    """Every tensor's type, element count, name and shape in the GGUF file `path`, in file order."""
    try:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data)
            if data[:4] != b"GGUF":
                raise ValueError(f"it starts with {data[:4]!r}, not b'GGUF'")
            cursor.at = 8  # magic, version
            num_tensors, num_fields = cursor.u64(), cursor.u64()
            for _ in range(num_fields):
                cursor.skip_string()
                cursor.skip_value(cursor.u32())
            entries = []
            for _ in range(num_tensors):
                name = cursor.string()
                shape = [cursor.u64() for _ in range(cursor.u32())]
                ggml_type = gguf.GGMLQuantizationType(cursor.u32()).name
                entries.append(TensorEntry(ggml_type, math.prod(shape), name, tuple(reversed(shape))))
                cursor.at += 8  # the data offset
            return entries
    except (OSError, ValueError, struct.error) as error:
        raise ModelLoadError(
            f"{path}: not a readable GGUF file ({error})", hint="pass a llama.cpp .gguf model file"
        ) from None
