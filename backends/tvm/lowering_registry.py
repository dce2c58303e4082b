"""The registry of TVM op lowerings: each ops_*.py module registers its ops' lowerings here with
`@lowering(op)`; lowering.py imports every such module and looks nodes up in `LOWERINGS`."""

from __future__ import annotations

from collections.abc import Callable

from tvm import relax

from kiln.backends.tvm.lowerer import Lowerer
from kiln.ir import Node

Lowering = Callable[[Lowerer, Node], list[relax.Expr]]
LOWERINGS: dict[str, Lowering] = {}


def lowering(op: str) -> Callable[[Lowering], Lowering]:
    def register(function: Lowering) -> Lowering:
        if op in LOWERINGS:
            raise ValueError(f"op {op!r} has two TVM lowerings")
        LOWERINGS[op] = function
        return function

    return register
