"""Weight layouts the TVM kernels read, made from the artifact's weights once, at load.

The artifact stores weights as the IR holds them ([N, K] rows, quantized blocks as the passes left
them); the kernels want them K-major. The transform names are recorded with the compiled code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.ir.ops.quant import unpack_int4


def _kn(weight: torch.Tensor) -> torch.Tensor:
    return weight.t().contiguous()


def _int4_kn(packing: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def transform(qweight: torch.Tensor) -> torch.Tensor:
        """[N, K/2] packed as `packing` → [K/2, N]: byte (k2, j) holds k = 2*k2 low, 2*k2 + 1 high."""
        values = unpack_int4(qweight, packing).t()  # [K, N] in 0..15
        return (values[0::2] | (values[1::2] << 4)).contiguous()

    return transform


TRANSFORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda t: t,
    "kn": _kn,
    "int4_kn_pairs": _int4_kn("pairs"),
    "int4_kn_gguf": _int4_kn("gguf"),
}


def apply_layout(transform: str, tensor: torch.Tensor) -> torch.Tensor:
    return TRANSFORMS[transform](tensor)


def int4_kn_transform(packing: str) -> str:
    return f"int4_kn_{packing}"
