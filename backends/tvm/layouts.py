"""Weight layouts the TVM kernels read, made from the artifact's weights once, at load.

The artifact stores weights as the IR holds them ([N, K] rows, quantized blocks as the passes left
them). The linear kernels read a strip of `tile` output columns at a time, so each weight is stored
as strips: [N / tile, K, tile], one contiguous block per strip (streamed, no strided rows). The
transform names are recorded with the compiled code (step.json).

    none                          as stored
    tiled:<tile>                  [N, X] -> [N / tile, X, tile]
    int4_tiled:<packing>:<tile>   4-bit [N, K / 2] packed as <packing> -> pairs along K (byte k2
                                  holds k = 2*k2 low, 2*k2 + 1 high), then tiled
    dot_tiled:<bits>:<packing>:<tile>
                                  the integer-dot kernels' layout (kernels/int_dot.py): per strip,
                                  steps of 4 k (8 for 4-bit), each `tile` columns x 4 bytes:
                                  [N / tile, K / step, tile * 4]. A 4-bit byte holds k (low nibble)
                                  and k + 4 (high); an int8 q is stored as q + 128 (q ^ 0x80)
"""

from __future__ import annotations

import torch

from kiln.ir.ops.quant import unpack_int4


def tiled(tensor: torch.Tensor, tile: int) -> torch.Tensor:
    rows, columns = tensor.shape
    return tensor.reshape(rows // tile, tile, columns).permute(0, 2, 1).contiguous()


def int4_pairs(qweight: torch.Tensor, packing: str) -> torch.Tensor:
    values = unpack_int4(qweight, packing)  # [N, K] in 0..15
    return values[:, 0::2] | (values[:, 1::2] << 4)


def dot_tiled(qweight: torch.Tensor, bits: int, packing: str, tile: int) -> torch.Tensor:
    if bits == 4:
        values = unpack_int4(qweight, packing)  # [N, K] in 0..15
        rows, k = values.shape
        nibbles = values.reshape(rows // tile, tile, k // 8, 2, 4)
        steps = nibbles[:, :, :, 0] | (nibbles[:, :, :, 1] << 4)
    else:
        rows, k = qweight.shape
        steps = (qweight.view(torch.uint8) ^ 0x80).view(torch.int8).reshape(rows // tile, tile, k // 4, 4)
    return steps.permute(0, 2, 1, 3).reshape(rows // tile, -1, tile * 4).contiguous()


def apply_layout(transform: str, tensor: torch.Tensor) -> torch.Tensor:
    kind, *args = transform.split(":")
    if kind == "none":
        return tensor
    if kind == "tiled":
        return tiled(tensor, int(args[0]))
    if kind == "int4_tiled":
        return tiled(int4_pairs(tensor, args[0]), int(args[1]))
    if kind == "dot_tiled":
        return dot_tiled(tensor, int(args[0]), args[1], int(args[2]))
    raise ValueError(f"unknown weight layout {transform!r}")


def tiled_transform(tile: int) -> str:
    return f"tiled:{tile}"


def int4_tiled_transform(packing: str, tile: int) -> str:
    return f"int4_tiled:{packing}:{tile}"


def dot_tiled_transform(bits: int, packing: str, tile: int) -> str:
    return f"dot_tiled:{bits}:{packing}:{tile}"
