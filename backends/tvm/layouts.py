"""Weight layouts the TVM kernels read, made from the program's weights once, when the artifact is
written (`stored_weights`): the artifact holds each weight as the kernels read it, so loading maps the
file and copies nothing.

The IR holds weights as [N, K] rows, quantized blocks as the passes left them. The linear kernels read a
strip of `tile` output columns at a time, so each weight is stored as strips: [N / tile, K, tile], one
contiguous block per strip (streamed, no strided rows). The transform names are recorded with the
compiled code (step.json), and each laid-out weight is stored as `<source>@<transform>`.

    none                          as stored
    tiled:<tile>                  [N, X] -> [N / tile, X, tile]
    int4_tiled:<packing>:<tile>   4-bit [N, K / 2] packed as <packing> -> pairs along K (byte k2
                                  holds k = 2*k2 low, 2*k2 + 1 high), then tiled
    dot_tiled:<bits>:<packing>:<tile>:<plane>:<offset>
                                  the integer-dot kernels' layout (kernels/int_dot.py) of the
                                  unsigned values u = q + offset: per strip, rows of `tile` columns x
                                  4 bytes, [N / tile, K / step, tile * 4]. plane 8: a byte a value,
                                  4 k a row. plane 4, 5, 6: u's low nibbles, 8 k a row: a byte holds
                                  k (low nibble) and k + 4 (high)
    factored_sub:<tile>:<per>     scales (or mins) s [N, G] as s = D * c exactly, D a float16 a run of
    factored_super:<tile>:<per>   <per> groups, c an int8 a group (GGUF K-quants: d * sc): c tiled
                                  [N / tile, G, tile] int8, D tiled [N / tile, G / per, tile] float16
    dot_high:...                  plane 5 and 6: the bits above the nibble, same row shape; a row
                                  covers 4 nibble rows (plane 5: bit 2p + h is row p's nibble h's
                                  fifth bit) or 2 (plane 6: bits 2(2p + h), +1)
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from kiln.backends.base import StoredWeight
from kiln.backends.tvm.abi import stored_name
from kiln.ir.ops.quant import unpack_int4


def tiled(tensor: torch.Tensor, tile: int) -> torch.Tensor:
    rows, columns = tensor.shape
    return tensor.reshape(rows // tile, tile, columns).permute(0, 2, 1).contiguous()


def int4_pairs(qweight: torch.Tensor, packing: str) -> torch.Tensor:
    values = unpack_int4(qweight, packing)  # [N, K] in 0..15
    return values[:, 0::2] | (values[:, 1::2] << 4)


def _values(qweight: torch.Tensor, bits: int, packing: str) -> torch.Tensor:
    return unpack_int4(qweight, packing) if bits == 4 else qweight


def _strips(columns: torch.Tensor, tile: int) -> torch.Tensor:
    """[N, K / step, 4] byte groups -> [N / tile, K / step, tile * 4]: a strip's row of bytes."""
    rows, steps, _ = columns.shape
    return columns.reshape(rows // tile, tile, steps, 4).permute(0, 2, 1, 3).reshape(rows // tile, steps, -1)


def dot_tiled(
    qweight: torch.Tensor, bits: int, packing: str, tile: int, plane: int, offset: int
) -> torch.Tensor:
    values = _values(qweight, bits, packing).to(torch.int16)
    rows, k = values.shape
    if plane == 8:
        stored = (values + offset).to(torch.uint8).view(torch.int8)
        return _strips(stored.reshape(rows, k // 4, 4), tile).contiguous()
    low = ((values + offset) & 15).to(torch.uint8).reshape(rows, k // 8, 2, 4)
    return _strips(low[:, :, 0] | (low[:, :, 1] << 4), tile).contiguous()


def dot_high(
    qweight: torch.Tensor, bits: int, packing: str, tile: int, plane: int, offset: int
) -> torch.Tensor:
    values = _values(qweight, bits, packing).to(torch.int16)
    rows, k = values.shape
    extra = plane - 4  # bits above the nibble, packed `8 // extra` pairs' worth a byte
    pairs = 8 // (2 * extra)
    high = ((values + offset) >> 4).to(torch.int32).reshape(rows, k // (8 * pairs), pairs, 2, 4)
    shifts = (extra * torch.arange(2 * pairs, dtype=torch.int32)).reshape(1, 1, pairs, 2, 1)
    packed = (high << shifts).sum(dim=(2, 3)).to(torch.uint8)
    return _strips(packed, tile).contiguous()


def _float16_divisors(base: np.ndarray, smallest: np.ndarray, largest: np.ndarray) -> np.ndarray:
    """For each run, the signed m of least size with base / m a float16 and every factor times m an
    int8 (factors smallest..largest); ValueError if a run has none."""
    chosen = np.zeros(base.shape, dtype=np.int64)
    flat = chosen.reshape(-1)
    bases, lows, highs = base.reshape(-1), smallest.reshape(-1), largest.reshape(-1)
    pending = np.arange(flat.size)
    for m in range(1, 129):
        for sign in (1, -1):  # a negative d flips the factors' signs
            candidate = sign * bases[pending] / m
            low, high = lows[pending] * m * sign, highs[pending] * m * sign
            fits = (
                (candidate.astype(np.float16).astype(np.float64) == candidate)
                & (np.minimum(low, high) >= -128)
                & (np.maximum(low, high) <= 127)
            )
            flat[pending[fits]] = sign * m
            pending = pending[~fits]
        if not pending.size:
            return chosen
    raise ValueError("scales are not a float16 times int8 factors per run")


def factored(scales: torch.Tensor, per: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(D [N, G / per] float16, c [N, G] int8) with D * c == scales bit for bit in float32: D is the
    gcd of each run's values on their common power-of-two unit, divided by the smallest m that makes it
    a float16 with c * m still an int8 (GGUF K-quants: D is the file's own d). Raises ValueError where
    none exists."""
    values = scales.to(torch.float32).numpy()
    rows, groups = values.shape
    runs = values.reshape(rows, groups // per, per)
    mantissa, exponent = np.frexp(runs)
    integers = (mantissa * (1 << 24)).astype(np.int64)  # exact: float32 has 24 bits
    unit = np.where(integers != 0, exponent.astype(np.int64) - 24, np.iinfo(np.int64).max)
    lowest = unit.min(axis=-1, keepdims=True)
    shift = np.where(integers != 0, unit - np.where(lowest == np.iinfo(np.int64).max, 0, lowest), 0)
    if (shift > 36).any():
        raise ValueError("scales span too many powers of two to factor")
    integers = integers << shift
    common = np.gcd.reduce(np.abs(integers), axis=-1, keepdims=True)
    empty = common == 0
    common = np.where(empty, 1, common)
    factors = integers // common
    base = np.where(empty, 0.0, np.ldexp(common.astype(np.float64), np.where(empty, 0, lowest)))
    chosen = _float16_divisors(base, factors.min(axis=-1, keepdims=True), factors.max(axis=-1, keepdims=True))
    base16 = (base / chosen).astype(np.float16)
    factors = factors * chosen.astype(np.int64)
    if not np.array_equal(base16.astype(np.float32) * factors.astype(np.float32), runs):
        raise ValueError("factored scales do not reproduce every scale")
    return (
        torch.from_numpy(base16.reshape(rows, groups // per)),
        torch.from_numpy(factors.astype(np.int8).reshape(rows, groups)),
    )


LAYOUT_ROWS = (
    4096  # about this many rows laid out together (whole tiles): bounds a large tensor's temporaries
)
_TILE_ARG = {
    "tiled": 0,
    "int4_tiled": 1,
    "factored_sub": 0,
    "factored_super": 0,
    "dot_tiled": 2,
    "dot_high": 2,
}


def apply_layout(transform: str, tensor: torch.Tensor) -> torch.Tensor:
    """Stacked experts [E, N, X] take a layout as the [E * N, X] rows they are: E experts' strips. Every
    layout keeps rows in strips of whole tiles, so a large tensor is laid out a slice of rows at a time."""
    if transform.split(":")[0] == "none":
        return tensor
    if tensor.dim() > 2:
        tensor = tensor.reshape(-1, tensor.shape[-1])
    kind, *args = transform.split(":")
    tile = int(args[_TILE_ARG[kind]]) if kind in _TILE_ARG else 0
    if not tile or tensor.shape[0] <= LAYOUT_ROWS:
        return _laid_out(transform, tensor)
    rows = -(-LAYOUT_ROWS // tile) * tile
    return torch.cat([_laid_out(transform, part) for part in tensor.split(rows)])


def _laid_out(transform: str, tensor: torch.Tensor) -> torch.Tensor:
    kind, *args = transform.split(":")
    if kind == "tiled":
        return tiled(tensor, int(args[0]))
    if kind == "int4_tiled":
        return tiled(int4_pairs(tensor, args[0]), int(args[1]))
    if kind in ("factored_sub", "factored_super"):
        tile, per = int(args[0]), int(args[1])
        base, factors = factored(tensor, per)
        return tiled(factors if kind == "factored_sub" else base, tile)
    if kind in ("dot_tiled", "dot_high"):
        bits, packing, tile, plane, offset = int(args[0]), args[1], int(args[2]), int(args[3]), int(args[4])
        make = dot_tiled if kind == "dot_tiled" else dot_high
        return make(tensor, bits, packing, tile, plane, offset)
    raise ValueError(f"unknown weight layout {transform!r}")


def tiled_transform(tile: int) -> str:
    return f"tiled:{tile}"


def int4_tiled_transform(packing: str, tile: int) -> str:
    return f"int4_tiled:{packing}:{tile}"


def dot_transform(kind: str, bits: int, packing: str, tile: int, plane: int, offset: int) -> str:
    return f"{kind}:{bits}:{packing}:{tile}:{plane}:{offset}"


def factored_transform(kind: str, tile: int, per: int) -> str:
    return f"factored_{kind}:{tile}:{per}"


def stored_weights(params: Iterable[dict[str, Any]]) -> list[StoredWeight]:
    """What the artifact stores for compiled code with these step.json params, each weight once."""
    stored: dict[str, StoredWeight] = {}
    for spec in params:
        name = stored_name(spec["source"], spec["transform"])
        if name not in stored:
            lay_out = functools.partial(apply_layout, spec["transform"])
            dtype = getattr(torch, spec["dtype"])
            stored[name] = StoredWeight(name, spec["source"], tuple(spec["shape"]), dtype, lay_out)
    return list(stored.values())
