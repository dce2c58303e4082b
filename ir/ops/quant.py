"""Weight-only quantized linear: storage layouts and their exact dequantization.

A quantized weight [N, K] is stored as `qweight` plus per-group `scales` (and `zeros`), groups of
`group_size` along K:

| scheme     | value                     | used by                              |
|------------|---------------------------|--------------------------------------|
| symmetric  | scale * q (q signed int8) | our int8 (one group per row), Q8_0   |
| zero_point | scale * (q - zero)        | our int4 (q in 0..15), Q4_0 (zero 8) |
| min        | scale * q + min           | GGUF Q4_1                            |

4-bit values are packed two per byte, in one of two orders: "pairs" (element 2i in the low nibble,
2i+1 in the high one, as ONNX MatMulNBits) or "gguf" (per group of 32: byte j holds element j low and
element j+16 high, as GGUF stores Q4_0/Q4_1). 8-bit values are stored as int8 ("none").
An optional `value_bits` says the stored integers need fewer bits than `bits` (GGUF Q5_0: -16..15 in
int8, value_bits 5; unsigned 0..2^b - 1 for the min and zero_point schemes, signed -2^(b-1)..2^(b-1) - 1
for symmetric): backends may pack them tighter. An optional `scale_block` says the scales (and
zeros) are a float per `scale_block` values times a small integer a group (GGUF K-quants: d * sc per
256): backends may store them so. Neither changes the arithmetic.
The arithmetic below is the same, in the same order, as the `gguf` package's dequantization, so GGUF
blocks imported here dequantize bit-identically. `quantized_embedding` gathers rows of such a weight
(a GGUF token embedding kept as its blocks) and dequantizes only those.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kiln.ir.ops.basic import linear_rows
from kiln.ir.ops.registry import OpDef, register, require, required
from kiln.ir.types import FLOAT_DTYPES, TensorType, shape_text

SCHEMES = ("symmetric", "zero_point", "min")
PACKINGS = {4: ("pairs", "gguf"), 8: ("none",)}


def unpack_int4(packed: torch.Tensor, packing: str) -> torch.Tensor:
    """uint8 [N, K/2] → uint8 values [N, K]."""
    low, high = packed & 0x0F, packed >> 4
    if packing == "pairs":
        return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)
    rows = packed.shape[0]
    low, high = low.reshape(rows, -1, 16), high.reshape(rows, -1, 16)
    return torch.cat((low, high), dim=-1).reshape(rows, -1)


def pack_int4(values: torch.Tensor, packing: str) -> torch.Tensor:
    """uint8 values in 0..15 [N, K] → uint8 [N, K/2]."""
    values = values.to(torch.uint8)
    rows = values.shape[0]
    if packing == "pairs":
        pairs = values.reshape(rows, -1, 2)
        return pairs[..., 0] | (pairs[..., 1] << 4)
    groups = values.reshape(rows, -1, 32)
    return (groups[..., :16] | (groups[..., 16:] << 4)).reshape(rows, -1)


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    scheme: str,
    packing: str,
    value_bits: int | None = None,  # packing hints only
    scale_block: int | None = None,
) -> torch.Tensor:
    """The float32 weight [N, K] a quantized layout stands for."""
    values = unpack_int4(qweight, packing) if bits == 4 else qweight
    rows, k = values.shape
    grouped = values.reshape(rows, k // group_size, group_size).to(torch.float32)
    scale = scales.to(torch.float32).unsqueeze(-1)
    if scheme == "symmetric":
        weight = grouped * scale
    elif scheme == "zero_point":
        assert zeros is not None
        weight = scale * (grouped - zeros.to(torch.float32).unsqueeze(-1))
    else:
        assert zeros is not None
        weight = scale * grouped + zeros.to(torch.float32).unsqueeze(-1)
    return weight.reshape(rows, k)


def _check_layout(
    qweight: TensorType,
    scales: TensorType,
    zeros: TensorType | None,
    k: int | str,
    attrs: dict[str, Any],
) -> int | str:
    """That qweight, scales (and zeros) hold a quantized [N, k] weight as `attrs` say; N."""
    bits, group, scheme, packing = (
        attrs.get("bits"),
        attrs.get("group_size"),
        attrs.get("scheme"),
        attrs.get("packing"),
    )
    require(
        bits in PACKINGS and packing in PACKINGS[bits],
        f"bits {bits} with packing {packing!r} is not a layout",
    )
    require(scheme in SCHEMES, f"scheme must be one of {SCHEMES}, got {scheme!r}")
    scale_block = attrs.get("scale_block", group)
    require(
        isinstance(scale_block, int) and isinstance(group, int) and group > 0 and scale_block % group == 0,
        f"scale_block {scale_block!r} must be a multiple of group_size {group}",
    )
    value_bits = attrs.get("value_bits", bits)
    require(
        isinstance(value_bits, int) and isinstance(bits, int) and 1 <= value_bits <= bits,
        f"value_bits {value_bits!r} must be 1..{bits}",
    )
    require(
        isinstance(k, int) and isinstance(group, int) and group > 0 and k % group == 0,
        f"in_features {k} is not a multiple of group_size {group}",
    )
    assert isinstance(k, int) and isinstance(group, int)
    require(qweight.rank == 2, f"qweight must be 2-D, got {qweight.text()}")
    n = qweight.shape[0]
    packed_k = k // 2 if bits == 4 else k
    want_dtype = "u8" if bits == 4 else "i8"
    require(
        qweight.dtype == want_dtype and qweight.shape[1] == packed_k,
        f"qweight {qweight.text()} does not hold {bits}-bit [{n},{k}] ({want_dtype}[{n},{packed_k}])",
    )
    require(
        scales.shape == (n, k // group) and scales.dtype in FLOAT_DTYPES,
        f"scales {scales.text()} must be float [{n},{k // group}]",
    )
    require(
        (zeros is None) == (scheme == "symmetric"),
        f"scheme {scheme} {'takes no' if zeros else 'needs'} zeros",
    )
    if zeros is not None:
        require(zeros.shape == scales.shape, f"zeros {shape_text(zeros.shape)} must match scales")
    return n


def _infer_quantized_linear(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    x, qweight, scales = (
        required(inputs[0], "x"),
        required(inputs[1], "qweight"),
        required(inputs[2], "scales"),
    )
    zeros = inputs[3] if len(inputs) > 3 else None
    bias = inputs[4] if len(inputs) > 4 else None
    require(x.dtype in FLOAT_DTYPES and x.rank >= 1, f"x must be a float tensor, got {x.text()}")
    n = _check_layout(qweight, scales, zeros, x.shape[-1], attrs)
    if bias is not None:
        require(bias.shape == (n,), f"bias {shape_text(bias.shape)} does not fit {n} outputs")
    return [TensorType(x.dtype, (*x.shape[:-1], n))]


def quantized_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    bits: int,
    group_size: int,
    scheme: str,
    packing: str,
    value_bits: int | None = None,  # packing hints for backends: the values fit in fewer bits,
    scale_block: int | None = None,  # the scales factor per scale_block values
) -> torch.Tensor:
    weight = dequantize(
        qweight, scales, zeros, bits=bits, group_size=group_size, scheme=scheme, packing=packing
    )
    return linear_rows(x, weight.to(x.dtype), bias)


register(
    OpDef(
        "quantized_linear",
        (3, 5),
        {
            "bits": "4 or 8",
            "group_size": "values per scale along in_features",
            "scheme": "symmetric | zero_point | min",
            "packing": "pairs | gguf (4-bit), none (8-bit)",
            "value_bits": "optional: the bits the values need (<= bits), a hint for tighter packing",
            "scale_block": "optional: scales are a float per this many values times an int8 a group",
        },
        _infer_quantized_linear,
        quantized_linear,
        doc="(x, qweight, scales, zeros?, bias?) -> x @ dequantize(...).T + bias",
    )
)


def _infer_quantized_embedding(
    inputs: Sequence[TensorType | None], attrs: dict[str, Any]
) -> list[TensorType]:
    ids, qweight, scales = (
        required(inputs[0], "ids"),
        required(inputs[1], "qweight"),
        required(inputs[2], "scales"),
    )
    zeros = inputs[3] if len(inputs) > 3 else None
    require(ids.dtype in ("i32", "i64"), f"ids must be integers, got {ids.dtype}")
    group = attrs.get("group_size")
    require(isinstance(group, int) and group > 0, f"group_size must be a positive int, got {group!r}")
    assert isinstance(group, int)
    k = scales.shape[-1] * group if isinstance(scales.shape[-1], int) else scales.shape[-1]
    _check_layout(qweight, scales, zeros, k, attrs)
    return [TensorType("f32", (*ids.shape, k))]


def quantized_embedding(
    ids: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    *,
    bits: int,
    group_size: int,
    scheme: str,
    packing: str,
    value_bits: int | None = None,
    scale_block: int | None = None,
) -> torch.Tensor:
    flat = ids.reshape(-1).long()
    rows = dequantize(
        qweight[flat],
        scales[flat],
        None if zeros is None else zeros[flat],
        bits=bits,
        group_size=group_size,
        scheme=scheme,
        packing=packing,
    )
    return rows.reshape(*ids.shape, rows.shape[-1])


register(
    OpDef(
        "quantized_embedding",
        (3, 4),
        {
            "bits": "as quantized_linear",
            "group_size": "as quantized_linear",
            "scheme": "as quantized_linear",
            "packing": "as quantized_linear",
            "value_bits": "as quantized_linear",
            "scale_block": "as quantized_linear",
        },
        _infer_quantized_embedding,
        quantized_embedding,
        doc="(ids, qweight, scales, zeros?) -> float32 rows of dequantize(...) at ids: only those rows "
        "are dequantized",
    )
)
