"""Float weights as llama.cpp's GGUF blocks, the blocks `llama-quantize` writes without an importance
matrix, bit for bit: Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 by gguf-py (llama.cpp's Python port of its reference
quantizers), Q4_K, Q5_K and Q6_K by kquant_encode.c (the reference quantizers' float32 arithmetic in their
order), compiled with the host's C compiler on first use and cached under $KILN_HOME/native."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import torch

from kiln.ir.deferred import Deferred, Weight, materialize
from kiln.passes.base import PassError

SOURCE = Path(__file__).with_name("kquant_encode.c")
K_ENCODERS = {"Q4_K": "encode_q4_k", "Q5_K": "encode_q5_k", "Q6_K": "encode_q6_k"}
GGUF_PY_ENCODERS = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"})
ENCODABLE = frozenset(K_ENCODERS) | GGUF_PY_ENCODERS
# no fused multiply-adds (llama.cpp's quantizers are built without them); the loops over lanes vectorize
BUILD_FLAGS = ("-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math")
VALUES_AT_ONCE = 1 << 21  # float values encoded together: bounds the temporaries of a large tensor


def block_size(ggml_type: str) -> int:
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_type]][0]


def row_bytes(ggml_type: str, k: int) -> int:
    values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_type]]
    return k // values * size


def _native_home() -> Path:
    home = os.environ.get("KILN_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "kiln") / "native"


@cache
def _k_library() -> ctypes.CDLL:
    """kquant_encode.c built for this host (once per source and flags: the file name holds their hash)."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(BUILD_FLAGS).encode()).hexdigest()[:12]
    library = _native_home() / f"kquant_encode-{platform.machine()}-{digest}.so"
    if not library.is_file():
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise PassError(
                "K-quant blocks (Q4_K, Q5_K, Q6_K) are encoded by a small C library built on first use, "
                "and no C compiler (cc) is on PATH",
                hint="install gcc (apt install gcc), or use --quantization q8_0 or q4_0",
            )
        library.parent.mkdir(parents=True, exist_ok=True)
        scratch = library.with_suffix(f".{os.getpid()}.tmp")
        result = subprocess.run(
            [compiler, *BUILD_FLAGS, "-o", str(scratch), str(SOURCE), "-lm"], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise PassError(f"cannot build {SOURCE.name}: {result.stderr.strip()[-500:]}")
        scratch.rename(library)  # atomic: a concurrent build sees the whole file or none
    loaded = ctypes.CDLL(str(library))
    for name in K_ENCODERS.values():
        function = getattr(loaded, name)
        function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        function.restype = None
    return loaded


def encode(values: np.ndarray, ggml_type: str) -> np.ndarray:
    """Float32 rows [rows, k] as `ggml_type` blocks, uint8 [rows, row_bytes]."""
    if ggml_type not in ENCODABLE:
        raise PassError(
            f"no encoder for GGUF type {ggml_type}", hint=f"one of {', '.join(sorted(ENCODABLE))}"
        )
    rows, k = values.shape
    if k % block_size(ggml_type):
        raise PassError(f"{ggml_type} needs rows of a multiple of {block_size(ggml_type)} values, not {k}")
    out = np.empty((rows, row_bytes(ggml_type, k)), dtype=np.uint8)
    step = max(1, VALUES_AT_ONCE // max(k, 1))
    starts = range(0, rows, step)
    if ggml_type in GGUF_PY_ENCODERS:
        for start in starts:
            part = np.ascontiguousarray(values[start : start + step], dtype=np.float32)
            out[start : start + step] = gguf.quants.quantize(part, gguf.GGMLQuantizationType[ggml_type])
        return out
    encoder = getattr(_k_library(), K_ENCODERS[ggml_type])

    def encode_rows(start: int) -> None:  # ctypes lets go of the GIL: the chunks run on every core
        part = np.ascontiguousarray(values[start : start + step], dtype=np.float32)
        encoder(part.ctypes.data, out[start : start + step].ctypes.data, part.size // 256)

    with ThreadPoolExecutor(min(len(starts), len(os.sched_getaffinity(0))) or 1) as pool:
        list(pool.map(encode_rows, starts))
    return out


@dataclass(frozen=True)
class EncodedTensor:
    """A float weight that becomes `ggml_type` blocks when read: the interface of a loader's
    ir.gguf_blocks.QuantizedTensor (read, rows, columns, dequantize), so the gguf import takes either."""

    ggml_type: str
    weight: Weight  # float, [rows, k] (or [experts, rows, k])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def read(self) -> np.ndarray:
        values = materialize(self.weight).detach().to(torch.float32).contiguous()
        return encode(values.reshape(-1, values.shape[-1]).numpy(), self.ggml_type)

    def rows(self, start: int, stop: int) -> EncodedTensor:
        weight = self.weight
        shape = (stop - start, *self.shape[1:])
        return EncodedTensor(
            self.ggml_type, Deferred(shape, torch.float32, lambda: materialize(weight)[start:stop])
        )

    def columns(self, start: int, stop: int) -> EncodedTensor:
        size = block_size(self.ggml_type)
        if start % size or stop % size:
            raise ValueError(f"columns {start}..{stop} do not start and end on {size}-element blocks")
        weight = self.weight
        shape = (*self.shape[:-1], stop - start)
        return EncodedTensor(
            self.ggml_type, Deferred(shape, torch.float32, lambda: materialize(weight)[..., start:stop])
        )

    def dequantize(self) -> torch.Tensor:
        values = gguf.quants.dequantize(self.read(), gguf.GGMLQuantizationType[self.ggml_type])
        return torch.from_numpy(np.ascontiguousarray(values, np.float32)).reshape(self.shape)
