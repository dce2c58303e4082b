"""The lowering registry: one rule per IR op, with a capability check run before anything is built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kiln.backends.onnx.context import LoweringContext, LoweringOptions
from kiln.ir import Node

# A rule writes ONNX nodes computing `node` into the context, naming its results `outputs`, and says
# which kernel it used (for the manifest): "onnx Gemm", "com.microsoft.MatMulNBits", ...
LowerFn = Callable[[LoweringContext, Node, list[str]], str]
CheckFn = Callable[[Node, LoweringOptions], str | None]  # why `node` cannot be lowered, or None


@dataclass(frozen=True)
class Rule:
    lower: LowerFn
    check: CheckFn | None = None


RULES: dict[str, Rule] = {}


def rule(op: str, check: CheckFn | None = None) -> Callable[[LowerFn], LowerFn]:
    def register(lower: LowerFn) -> LowerFn:
        if op in RULES:
            raise ValueError(f"op {op!r} has two ONNX lowering rules")
        RULES[op] = Rule(lower, check)
        return lower

    return register
