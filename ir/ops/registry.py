"""The op registry: every op once, with its arity, attributes, shape/dtype rule and torch reference."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kiln.ir.types import TensorType

InferFn = Callable[[Sequence[TensorType | None], dict[str, Any]], list[TensorType]]
ReferenceFn = Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]


class ShapeError(ValueError):
    """An op's inputs or attributes do not fit its rule; the verifier adds which node it was."""


@dataclass(frozen=True)
class OpDef:
    """An op: `num_inputs` is (min, max); inputs past `min` are optional and may be None.

    `attrs` maps each attribute name to a one-line doc; `pure` ops may be removed when unused.
    The reference takes the input tensors positionally and the attributes as keywords.
    """

    name: str
    num_inputs: tuple[int, int]
    attrs: dict[str, str]
    infer: InferFn
    reference: ReferenceFn
    pure: bool = True
    doc: str = ""


REGISTRY: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    if op.name in REGISTRY:
        raise ValueError(f"op {op.name!r} is registered twice")
    REGISTRY[op.name] = op
    return op


def get_op(name: str) -> OpDef:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; registered ops: {', '.join(sorted(REGISTRY))}") from None


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ShapeError(message)


def required(value: TensorType | None, what: str) -> TensorType:
    if value is None:
        raise ShapeError(f"{what} is required")
    return value
