"""Value types: a dtype, a shape whose dims are ints or named symbols, and an optional weight layout."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("f32", "f16", "bf16", "f8e4m3", "i64", "i32", "u8", "i8", "bool")  # f8e4m3: KV cache only
_TORCH_NAMES = {
    "f32": "float32",
    "f16": "float16",
    "bf16": "bfloat16",
    "f8e4m3": "float8_e4m3fn",
    "i64": "int64",
    "i32": "int32",
    "u8": "uint8",
    "i8": "int8",
    "bool": "bool",
}


def __getattr__(name: str) -> Any:
    """DTYPES (IR name -> torch dtype) and DTYPE_OF_TORCH, made when first asked for: torch is not
    imported by a process that only reads types (a serving process)."""
    if name not in ("DTYPES", "DTYPE_OF_TORCH"):
        raise AttributeError(f"module 'kiln.ir.types' has no attribute {name!r}")
    import torch

    dtypes = {ir: getattr(torch, name) for ir, name in _TORCH_NAMES.items()}
    globals().update(DTYPES=dtypes, DTYPE_OF_TORCH={v: k for k, v in dtypes.items()})
    return globals()[name]


FLOAT_DTYPES = frozenset({"f32", "f16", "bf16"})

Dim = int | str  # an int, or a symbol such as "T" (tokens in the step) bound when the graph runs
Shape = tuple[Dim, ...]

QUANT_SCHEMES = ("symmetric", "zero_point", "min")
_SYMBOL = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class QuantLayout:
    """How a quantized weight is stored: `bits` per value, one scale (and zero point or min) per group.

    `packing` names the byte layout, e.g. "gguf_q4_1" (GGUF blocks as stored) or "kiln_int4".
    """

    bits: int
    group_size: int
    scheme: str
    packing: str

    def __post_init__(self) -> None:
        if self.scheme not in QUANT_SCHEMES:
            raise ValueError(f"quant scheme {self.scheme!r} is not one of {QUANT_SCHEMES}")
        if self.bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"quant bits {self.bits} is not supported")

    def text(self) -> str:
        return f"q{self.bits}/g{self.group_size}/{self.scheme}/{self.packing}"

    @classmethod
    def parse(cls, text: str) -> QuantLayout:
        bits, group, scheme, packing = text.split("/")
        return cls(int(bits.removeprefix("q")), int(group.removeprefix("g")), scheme, packing)


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: Shape
    quant: QuantLayout | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_NAMES)}")
        for dim in self.shape:
            if isinstance(dim, str) and not _SYMBOL.match(dim):
                raise ValueError(f"bad symbolic dim {dim!r}")
            if isinstance(dim, int) and dim < 0:
                raise ValueError(f"negative dim {dim} in shape {self.shape}")

    @property
    def rank(self) -> int:
        return len(self.shape)

    def text(self) -> str:
        layout = f"{{{self.quant.text()}}}" if self.quant else ""
        return f"{self.dtype}{shape_text(self.shape)}{layout}"

    @classmethod
    def parse(cls, text: str) -> TensorType:
        match = re.fullmatch(r"(\w+)\[([^\]]*)\](?:\{([^}]*)\})?", text.strip())
        if not match:
            raise ValueError(f"cannot parse type {text!r}")
        dtype, dims, layout = match.groups()
        shape = tuple(int(d) if d.lstrip("-").isdigit() else d for d in dims.split(",") if d)
        return cls(dtype, shape, QuantLayout.parse(layout) if layout else None)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorType:
        from kiln.ir.types import DTYPE_OF_TORCH

        return cls(DTYPE_OF_TORCH[tensor.dtype], tuple(tensor.shape))


def shape_text(shape: Shape | list[Dim]) -> str:
    """`[T,576]`: how messages and the text form show a shape."""
    return "[" + ",".join(str(d) for d in shape) + "]"


def numel_factors(shape: Shape) -> tuple[int, tuple[str, ...]]:
    """A shape's element count as (product of int dims, sorted symbols)."""
    const = 1
    symbols: list[str] = []
    for dim in shape:
        if isinstance(dim, int):
            const *= dim
        else:
            symbols.append(dim)
    return const, tuple(sorted(symbols))
