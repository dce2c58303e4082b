"""A small ONNX graph builder: fresh value names, nodes, deduplicated constants."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ONNX_DTYPES: dict[str, int] = {
    "f32": TensorProto.FLOAT,
    "f16": TensorProto.FLOAT16,
    "bf16": TensorProto.BFLOAT16,
    "i64": TensorProto.INT64,
    "i32": TensorProto.INT32,
    "u8": TensorProto.UINT8,
    "i8": TensorProto.INT8,
    "bool": TensorProto.BOOL,
}
CONTRIB_DOMAIN = "com.microsoft"


class OnnxBuilder:
    """Collects nodes and constant initializers; `value` names are unique within the graph."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.constants: list[onnx.TensorProto] = []
        self.domains: set[str] = set()
        self._counter = 0
        self._const_names: dict[tuple[str, tuple[int, ...], bytes], str] = {}

    def fresh(self, hint: str) -> str:
        self._counter += 1
        return f"_{hint}_{self._counter}"

    def node(
        self,
        op_type: str,
        inputs: Sequence[str],
        outputs: Sequence[str] | int = 1,
        *,
        domain: str = "",
        hint: str | None = None,
        **attrs: Any,
    ) -> list[str]:
        """Append a node; `outputs` is the names to write, or how many fresh ones to make."""
        names = (
            [self.fresh(hint or op_type.lower()) for _ in range(outputs)]
            if isinstance(outputs, int)
            else list(outputs)
        )
        if domain:
            self.domains.add(domain)
        self.nodes.append(
            helper.make_node(op_type, list(inputs), names, name=self.fresh(op_type), domain=domain, **attrs)
        )
        return names

    def op(self, op_type: str, *inputs: str, domain: str = "", **attrs: Any) -> str:
        """A single-output node with a fresh output name."""
        (out,) = self.node(op_type, inputs, 1, domain=domain, **attrs)
        return out

    def const(self, values: Any, dtype: type | np.dtype = np.int64) -> str:
        """A constant initializer (deduplicated); scalars stay 0-d."""
        array = np.asarray(values, dtype=dtype)
        key = (str(array.dtype), tuple(array.shape), array.tobytes())
        name = self._const_names.get(key)
        if name is None:
            name = self.fresh("const")
            self.constants.append(numpy_helper.from_array(array, name))
            self._const_names[key] = name
        return name
