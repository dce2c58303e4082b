"""Weight layouts the TVM kernels read, made from the artifact's weights once, at load.

The artifact stores weights as the IR holds them ([N, K] rows, quantized blocks as the passes left
them). The linear kernels read a strip of `tile` output columns at a time, so each weight is stored
as strips: [N / tile, K, tile], one contiguous block per strip (streamed, no strided rows). The
transform names are recorded with the compiled code (step.json).

    none                          as stored
    tiled:<tile>                  [N, X] -> [N / tile, X, tile]
    int4_tiled:<packing>:<tile>   4-bit [N, K / 2] packed as <packing> -> pairs along K (byte k2
                                  holds k = 2*k2 low, 2*k2 + 1 high), then tiled
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


def apply_layout(transform: str, tensor: torch.Tensor) -> torch.Tensor:
    kind, *args = transform.split(":")
    if kind == "none":
        return tensor
    if kind == "tiled":
        return tiled(tensor, int(args[0]))
    if kind == "int4_tiled":
        return tiled(int4_pairs(tensor, args[0]), int(args[1]))
    raise ValueError(f"unknown weight layout {transform!r}")


def tiled_transform(tile: int) -> str:
    return f"tiled:{tile}"


def int4_tiled_transform(packing: str, tile: int) -> str:
    return f"int4_tiled:{packing}:{tile}"
