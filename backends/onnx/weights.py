"""The ONNX graph's weight inputs and how each is made from the artifact's weights at load time.

The artifact stores its weights once (safetensors). The ONNX model declares them as graph inputs and
never holds their bytes; a loader computes each `WeightBinding` from the weights dict (a float param as
it is, zero-copy; a quantized one repacked for MatMulNBits) and hands it to the runtime in memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kiln.backends.base import BackendError
from kiln.ir import DTYPES, deferred
from kiln.ir.ops.quant import dequantize, pack_int4, unpack_int4

# kind → what the tensor is: the param itself, or a MatMulNBits operand, or the dequantized float weight
# (or stacked experts)
KINDS = ("param", "nbits_qweight", "nbits_scales", "nbits_zeros", "nbits_mins", "dequantized")


@dataclass(frozen=True)
class WeightBinding:
    name: str  # the ONNX graph input
    kind: str
    sources: list[str]  # IR params it is computed from: [weight] or [qweight, scales, zeros?]
    dtype: str  # IR dtype of the bound tensor
    shape: list[int]
    attrs: dict[str, Any] = field(default_factory=dict)  # the quantized layout, block_size, ...

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WeightBinding:
        return cls(**data)


def _values(qweight: torch.Tensor, bits: int, packing: str) -> torch.Tensor:
    """Unsigned level of every element, uint8 [N, K] (8-bit values shifted by 128)."""
    if bits == 4:
        return unpack_int4(qweight, packing)
    return (qweight.to(torch.int16) + 128).to(torch.uint8)


def _per_block(groups: torch.Tensor, group_size: int, block_size: int) -> torch.Tensor:
    """[N, K/group] → [N * K/block]: each group's value repeated for the blocks it spans."""
    return groups.repeat_interleave(group_size // block_size, dim=1).reshape(-1).contiguous()


def integral_zero_points(scheme: str, bits: int, zeros: torch.Tensor | None) -> bool:
    """Whether MatMulNBits' uint8 zero points hold the layout exactly (its fast CPU path): always for
    symmetric, for zero_point when every zero is a level (Q4_0's 8); never for min (GGUF Q4_1)."""
    if scheme == "symmetric":
        return True
    if scheme == "min" or zeros is None:
        return False
    wide = deferred.materialize(zeros).to(torch.float32)
    return bool(((wide == wide.round()) & (wide >= 0) & (wide < 2**bits)).all())


def _zero_levels(binding: WeightBinding, zeros: torch.Tensor | None, rows: int) -> torch.Tensor:
    """uint8 [N, K/group] zero point per group: 128 for int8 (stored shifted by 128), 0 for unsigned
    4-bit symmetric and for layouts whose offset goes through `nbits_mins`, else the integral zeros."""
    attrs = binding.attrs
    groups = binding.attrs["k"] // attrs["group_size"]
    if attrs["scheme"] == "symmetric":
        return torch.full((rows, groups), 128 if attrs["bits"] == 8 else 0, dtype=torch.uint8)
    if not attrs["integral"]:
        return torch.zeros((rows, groups), dtype=torch.uint8)
    assert zeros is not None
    return zeros.to(torch.float32).round().to(torch.uint8)


def _pack_zero_points(levels: torch.Tensor, binding: WeightBinding) -> torch.Tensor:
    """[N, K/group] levels → MatMulNBits' zero_points: per block, 4-bit ones two per byte (low first)."""
    attrs = binding.attrs
    per_block = levels.repeat_interleave(attrs["group_size"] // attrs["block_size"], dim=1)
    if attrs["bits"] == 8:
        return per_block.reshape(-1)
    if per_block.shape[1] % 2:
        per_block = torch.cat((per_block, per_block.new_zeros(per_block.shape[0], 1)), dim=1)
    return pack_int4(per_block, "pairs").reshape(-1)


def _mins(binding: WeightBinding, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """[N, K/group] the offset of each group's values: scale * q + min. GGUF Q4_1 stores min; a float
    zero point z stands for min = -scale * z."""
    if binding.attrs["scheme"] == "min":
        return zeros.to(torch.float32)
    return -scales.to(torch.float32) * zeros.to(torch.float32)


def _dequantized(tensors: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    """The float weight [N, K], or stacked experts [E, N, K] dequantized as the [E * N, K] rows they are."""
    qweight = tensors[0]
    rows = [t.reshape(-1, t.shape[-1]) for t in tensors]
    layout = {key: attrs[key] for key in ("bits", "group_size", "scheme", "packing")}
    weight = dequantize(rows[0], rows[1], rows[2] if len(rows) > 2 else None, **layout)
    return weight.reshape(*qweight.shape[:-1], -1)


def materialize(binding: WeightBinding, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tensor bound to `binding.name`, computed from the artifact's weights."""
    missing = [name for name in binding.sources if name not in weights]
    if missing:
        raise BackendError(f"no weight {missing[0]} for ONNX input {binding.name}")
    tensors = [deferred.materialize(weights[name]) for name in binding.sources]
    attrs = binding.attrs
    if binding.kind == "param":
        result = tensors[0]
    elif binding.kind == "dequantized":
        result = _dequantized(tensors, attrs)
    elif binding.kind == "nbits_qweight":
        values = _values(tensors[0], attrs["bits"], attrs["packing"])
        packed = pack_int4(values, "pairs") if attrs["bits"] == 4 else values
        result = packed.reshape(binding.shape)
    elif binding.kind == "nbits_scales":
        result = _per_block(tensors[1].to(torch.float32), attrs["group_size"], attrs["block_size"])
    elif binding.kind == "nbits_zeros":
        zeros = tensors[2] if len(tensors) > 2 else None
        result = _pack_zero_points(_zero_levels(binding, zeros, tensors[0].shape[0]), binding)
    elif binding.kind == "nbits_mins":
        result = _mins(binding, tensors[1], tensors[2])
    else:
        raise BackendError(f"ONNX input {binding.name}: unknown weight kind {binding.kind!r}")
    result = result.to(DTYPES[binding.dtype]).contiguous()
    if list(result.shape) != binding.shape:
        raise BackendError(
            f"ONNX input {binding.name} is {list(result.shape)} from the weights, "
            f"the model says {binding.shape}"
        )
    return result
