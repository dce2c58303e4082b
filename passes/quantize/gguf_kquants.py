"""GGUF K-quants and Q5 blocks as the IR's grouped layouts, without re-quantizing.

Every supported type decodes to `scale[g] * q + min[g]` (or `scale[g] * q`) over groups of 16 or 32
values, with small integers q. The integers and the per-group floats are read out by `gguf`'s own
dequantization of probe blocks, so the arithmetic (f16 → f32, `d * sc`, `dmin * m`) is gguf's to the
bit and dequantizing our layout gives exactly `gguf.quants.dequantize`:

    q        the block with unit scales and no min (d = 1, sub-block scales 1, mins 0)
    scale    the block with every q set to 1 (the min term zeroed where there is one)
    min      the block with every q set to 0 (= -dmin * m)

For Q4_K, Q5_K and Q6_K the scale and min probes are computed per group from the block header with
gguf's own operations (`_group_floats`: the same float32 products, bit for bit), not by dequantizing
every value of two probe copies.

Q5_0 and Q5_1 have one group a block, whose f16 `d` (and `m`) are the scale and min as they are.

| type | IR layout (bits, group, scheme)           | q range  |
|------|-------------------------------------------|----------|
| Q4_K | 4-bit pairs, 32, min                      | 0..15    |
| Q2_K | 4-bit pairs, 16, min                      | 0..3     |
| Q5_K | 8-bit, 32, min                            | 0..31    |
| Q5_1 | 8-bit, 32, min                            | 0..31    |
| Q5_0 | 8-bit, 32, symmetric                      | -16..15  |
| Q6_K | 8-bit, 16, symmetric                      | -32..31  |
| Q3_K | 8-bit, 16, symmetric                      | -4..3    |

Scales and mins are float32 (a product `d * sc` is not always an f16), or float16 where they are the
block's own f16 (Q5_0, Q5_1). The 3- to 6-bit types are held one value a byte, with `value_bits`
saying how many bits they need: backends pack them tighter (the TVM CPU kernels: 4-bit nibbles plus
a plane of the 5th and 6th bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kiln.ir.ops.quant import pack_int4

Fill = tuple[tuple[int, int, bytes], ...]  # (start, end, the bytes repeated over [start, end)) in a block
_ONE_F16 = np.float16(1.0).tobytes()
_ZERO_F16 = np.float16(0.0).tobytes()


@dataclass(frozen=True)
class KQuant:
    block_bytes: int
    values: int  # per block
    group: int
    bits: int  # how the IR stores q: 4 (packed pairs) or 8 (int8)
    scheme: str  # "min" or "symmetric"
    unit: Fill  # d = 1, sub-block scales 1, mins 0
    q_one: Fill  # every q (after its offset) = 1
    q_zero: Fill  # every q = 0
    no_min: Fill  # the min term zeroed (dmin = 0, or m = 0)
    block_floats: tuple[int, ...] = ()  # one group a block: the f16 scale (and min) offsets, read as is
    value_bits: int = 8  # the bits q needs (see "q range"): a packing hint for backends


_SCALES_K_UNIT = bytes([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1])  # Q4_K/Q5_K 6-bit packing: sc = 1, m = 0

KQUANTS: dict[str, KQuant] = {
    "Q4_K": KQuant(
        144,
        256,
        32,
        4,
        "min",
        unit=((0, 2, _ONE_F16), (2, 4, _ZERO_F16), (4, 16, _SCALES_K_UNIT)),
        q_one=((16, 144, b"\x11"),),
        q_zero=((16, 144, b"\x00"),),
        no_min=((2, 4, _ZERO_F16),),
        value_bits=4,
    ),
    "Q5_K": KQuant(
        176,
        256,
        32,
        8,
        "min",
        unit=((0, 2, _ONE_F16), (2, 4, _ZERO_F16), (4, 16, _SCALES_K_UNIT)),
        q_one=((16, 48, b"\x00"), (48, 176, b"\x11")),
        q_zero=((16, 176, b"\x00"),),
        no_min=((2, 4, _ZERO_F16),),
        value_bits=5,
    ),
    "Q6_K": KQuant(  # q = (ql | qh << 4) - 32; 33 = ql 1, qh 2; 32 = ql 0, qh 2
        210,
        256,
        16,
        8,
        "symmetric",
        unit=((192, 208, b"\x01"), (208, 210, _ONE_F16)),
        q_one=((0, 128, b"\x11"), (128, 192, b"\xaa")),
        q_zero=((0, 128, b"\x00"), (128, 192, b"\xaa")),
        no_min=(),
        value_bits=6,
    ),
    "Q2_K": KQuant(
        84,
        256,
        16,
        4,
        "min",
        unit=((0, 16, b"\x01"), (80, 82, _ONE_F16), (82, 84, _ZERO_F16)),
        q_one=((16, 80, b"\x55"),),
        q_zero=((16, 80, b"\x00"),),
        no_min=((82, 84, _ZERO_F16),),
        value_bits=2,
    ),
    "Q3_K": KQuant(  # q = ql - 4 * (1 - hmask bit); 6-bit scales minus 32: 33 = nibble 1, high bits 2
        110,
        256,
        16,
        8,
        "symmetric",
        unit=((96, 104, b"\x11"), (104, 108, b"\xaa"), (108, 110, _ONE_F16)),
        q_one=((0, 32, b"\xff"), (32, 96, b"\x55")),
        q_zero=((0, 32, b"\xff"), (32, 96, b"\x00")),
        no_min=(),
        value_bits=3,
    ),
    "Q5_0": KQuant(  # q = (ql | qh << 4) - 16; one group a block: d is the scale
        22,
        32,
        32,
        8,
        "symmetric",
        unit=((0, 2, _ONE_F16),),
        q_one=(),
        q_zero=(),
        no_min=(),
        block_floats=(0,),
        value_bits=5,
    ),
    "Q5_1": KQuant(  # one group a block: d and m are the scale and min
        24,
        32,
        32,
        8,
        "min",
        unit=((0, 2, _ONE_F16), (2, 4, _ZERO_F16)),
        q_one=(),
        q_zero=(),
        no_min=(),
        block_floats=(0, 2),
        value_bits=5,
    ),
}


@dataclass
class ImportedBlocks:
    q: torch.Tensor  # [rows, k]: uint8 packed pairs [rows, k / 2] for 4 bits, int8 for 8 bits
    scales: torch.Tensor  # float32 [rows, k / group] (float16 for Q5_0, Q5_1: their own d and m)
    mins: torch.Tensor | None  # [rows, k / group] as scales, the "min" scheme's offsets
    kind: KQuant


def _filled(blocks: np.ndarray, *fills: Fill) -> np.ndarray:
    out = blocks.copy()
    for fill in fills:
        for start, end, pattern in fill:
            out[:, start:end] = np.frombuffer(pattern * ((end - start) // len(pattern)), dtype=np.uint8)
    return out


def _dequantized(blocks: np.ndarray, ggml_type: str) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[ggml_type])


def _group_floats(ggml_type: str, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray | None] | None:
    """What the scale and min probes give, computed per group with gguf's own operations instead of
    dequantizing every value of two probe copies: Q4_K and Q5_K decode `d * sc * q - dmin * m`, so a
    probe of q = 1 and dmin = 0 gives d * sc, and one of q = 0 gives (d * sc) * 0 - dmin * m; Q6_K decodes
    d * sc * q. None for the other types (their probes are dequantized)."""
    import gguf

    if ggml_type in ("Q4_K", "Q5_K"):
        d = flat[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = flat[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = gguf.quants.Q4_K.get_scale_min(flat[:, 4:16])
        scale = d * sc.astype(np.float32)
        return scale, scale * np.float32(0) - dmin * m.astype(np.float32)
    if ggml_type == "Q6_K":
        d = flat[:, 208:210].copy().view(np.float16).astype(np.float32)
        return d * flat[:, 192:208].copy().view(np.int8).astype(np.float32), None
    return None


def import_kquant(ggml_type: str, blocks: np.ndarray, shape: tuple[int, int]) -> ImportedBlocks:
    """`blocks` (uint8, one row of blocks per output row) of a type in KQUANTS, as grouped values."""
    kind = KQUANTS[ggml_type]
    rows, k = shape
    flat = np.ascontiguousarray(blocks).view(np.uint8).reshape(-1, kind.block_bytes)
    groups = k // kind.group

    def per_group(values: np.ndarray) -> torch.Tensor:
        first = values.reshape(rows, groups, kind.group)[..., 0]
        return torch.from_numpy(np.ascontiguousarray(first, dtype=np.float32))

    def block_float(offset: int) -> torch.Tensor:  # the f16 as it is (gguf's `d * 1.0` is exact)
        values = flat[:, offset : offset + 2].copy().view(np.float16)
        return torch.from_numpy(values.reshape(rows, groups))

    q = _dequantized(_filled(flat, kind.unit), ggml_type).reshape(rows, k)
    floats = _group_floats(ggml_type, flat)
    if floats is not None:
        scales = torch.from_numpy(floats[0].reshape(rows, groups))
        mins = None if floats[1] is None else torch.from_numpy(floats[1].reshape(rows, groups))
    elif kind.block_floats:
        scales = block_float(kind.block_floats[0])
        mins = block_float(kind.block_floats[1]) if kind.scheme == "min" else None
    else:
        scales = per_group(_dequantized(_filled(flat, kind.q_one, kind.no_min), ggml_type))
        mins = (
            per_group(_dequantized(_filled(flat, kind.q_zero), ggml_type)) if kind.scheme == "min" else None
        )
    values = torch.from_numpy(np.ascontiguousarray(q)).to(torch.int8)
    packed = pack_int4(values.to(torch.uint8), "pairs") if kind.bits == 4 else values
    return ImportedBlocks(packed, scales, mins, kind)


IMPORT_ROWS = 4096  # rows imported together: bounds gguf's float32 temporaries for a large tensor


def import_kquant_rows(ggml_type: str, blocks: np.ndarray, shape: tuple[int, int]) -> ImportedBlocks:
    """`import_kquant`, a slice of rows at a time (the same values; less memory for a large tensor)."""
    rows, k = shape
    if rows <= IMPORT_ROWS:
        return import_kquant(ggml_type, blocks, shape)
    flat = np.ascontiguousarray(blocks).reshape(rows, -1)
    parts = [
        import_kquant(ggml_type, flat[start : start + IMPORT_ROWS], (min(IMPORT_ROWS, rows - start), k))
        for start in range(0, rows, IMPORT_ROWS)
    ]
    mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts if p.mins is not None])
    return ImportedBlocks(
        torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]), mins, parts[0].kind
    )
