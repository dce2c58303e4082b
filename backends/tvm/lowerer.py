"""The state of one graph's lowering to Relax (`Lowerer`: its builder, values, weight parameters and
kernels) and the row helpers every op lowering uses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tvm import relax, tirx

from kiln.backends.base import BackendError
from kiln.backends.tvm.kernels import int_dot
from kiln.backends.tvm.kernels import linear as linear_kernels
from kiln.backends.tvm.kernels.kv_format import FP8
from kiln.ir import Graph, Node, TensorType, Value

ROW_BLOCK = linear_kernels.ROW_BLOCK
TVM_DTYPES: dict[str, str] = {  # IR dtype → TVM's name for it
    "f32": "float32",
    "f16": "float16",
    "bf16": "bfloat16",
    "f8e4m3": FP8,
    "i64": "int64",
    "i32": "int32",
    "u8": "uint8",
    "i8": "int8",
    "bool": "bool",
}


@dataclass(frozen=True)
class ParamSpec:
    """A `step` parameter: IR weight `source` after layout `transform` (see layouts.py)."""

    name: str
    source: str
    transform: str
    shape: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "transform": self.transform,
            "shape": list(self.shape),
            "dtype": self.dtype,
        }


KernelBuilder = Callable[[], tirx.PrimFunc]
Schedule = Callable[[str, tirx.PrimFunc, dict[str, Any]], tuple[tirx.PrimFunc, str]]
# (kind, key, the generic unscheduled kernel, info) -> (a kernel for the decode rows, origin) or None
DecodeKernels = Callable[
    [str, tuple[Any, ...], tirx.PrimFunc, dict[str, Any]], tuple[tirx.PrimFunc, str] | None
]


@dataclass
class Lowerer:
    """State while lowering one graph: the Relax builder, values, params and kernels made so far."""

    graph: Graph
    target_kind: str  # "cpu" | "cuda"
    schedule: Schedule
    builder: relax.BlockBuilder = field(default_factory=relax.BlockBuilder)
    dims: dict[str, Any] = field(default_factory=dict)
    values: dict[str, relax.Expr] = field(default_factory=dict)
    params: dict[tuple[str, str], relax.Var] = field(default_factory=dict)
    param_specs: list[ParamSpec] = field(default_factory=list)
    kernels: dict[tuple[Any, ...], relax.GlobalVar] = field(default_factory=dict)
    kernel_origins: dict[str, str] = field(default_factory=dict)
    decode_kernels: DecodeKernels | None = None  # set while lowering `decode`
    int_dot: int_dot.Isa | None = None  # the CPU's integer dot-product variant (None: float kernels)
    activation_bits: int = 16  # the integer-dot kernels' activation quantization (int_dot.py)

    def sibling(self, graph: Graph, decode_kernels: DecodeKernels | None = None) -> Lowerer:
        """A lowerer of another function into the same module: fresh Relax vars and dims (a var may not be
        shared by two functions), the same builder and kernels."""
        return Lowerer(
            graph,
            self.target_kind,
            self.schedule,
            builder=self.builder,
            kernels=self.kernels,
            kernel_origins=self.kernel_origins,
            decode_kernels=decode_kernels,
            int_dot=self.int_dot,
            activation_bits=self.activation_bits,
        )

    def dim(self, dim: int | str) -> Any:
        if isinstance(dim, int):
            return dim
        if dim not in self.dims:
            self.dims[dim] = tirx.Var(dim, "int64")
        return self.dims[dim]

    def sinfo(self, tensor_type: TensorType) -> relax.TensorType:
        return relax.TensorType([self.dim(d) for d in tensor_type.shape], TVM_DTYPES[tensor_type.dtype])

    def param(
        self,
        value: Value,
        transform: str = "none",
        shape: tuple[int, ...] | None = None,
        dtype_name: str | None = None,
    ) -> relax.Var:
        key = (value.name, transform)
        if key not in self.params:
            given = tuple(int(d) for d in value.type.shape)  # params have fixed shapes
            layout_shape = shape if shape is not None else given
            dtype = TVM_DTYPES[dtype_name or value.type.dtype]
            name = f"w{len(self.param_specs)}"
            self.params[key] = relax.Var(name, relax.TensorType(list(layout_shape), dtype))
            self.param_specs.append(ParamSpec(name, value.name, transform, layout_shape, dtype))
        return self.params[key]

    def value(self, value: Value | None) -> relax.Expr:
        assert value is not None
        if value.kind.value == "param":
            return self.param(value)
        return self.values[value.name]

    def kernel(
        self, kind: str, key: tuple[Any, ...], make: KernelBuilder, info: dict[str, Any]
    ) -> relax.GlobalVar:
        full_key = (kind, *key)
        if self.decode_kernels is not None:
            decode_key = ("decode", *full_key)
            if decode_key not in self.kernels:
                found = self.decode_kernels(kind, key, make(), info)
                self.kernels[decode_key] = self._add_kernel(f"{kind}_decode", *found) if found else None
            if self.kernels[decode_key] is not None:
                return self.kernels[decode_key]
        if full_key not in self.kernels:
            self.kernels[full_key] = self._add_kernel(kind, *self.schedule(kind, make(), info))
        return self.kernels[full_key]

    def _add_kernel(self, prefix: str, func: tirx.PrimFunc, origin: str) -> relax.GlobalVar:
        name = f"{prefix}_{len(self.kernel_origins)}"
        func = func.with_attr("global_symbol", name).with_attr("op_pattern", 8)  # opaque: never refused
        self.kernel_origins[name] = origin
        return self.builder.add_func(func, name)

    def emit(self, expr: relax.Expr) -> relax.Var:
        return self.builder.emit(expr)


def out_sinfo(lw: Lowerer, node: Node, index: int = 0) -> relax.TensorType:
    return lw.sinfo(node.outputs[index].type)


ROW_COUNTS = "row_counts"  # int64[2]: the real token rows and logits rows (the rest is padding)


def row_blocks(lw: Lowerer, node: Node) -> Any:
    """The blocks of 4 rows of the node's first input, whose row count must be a padded one (T or L)
    or a fixed multiple of 4 (an image encoder's)."""
    leading = node.inputs[0].type.shape[:-1] if node.inputs[0] is not None else ()
    if len(leading) == 1 and isinstance(leading[0], int) and leading[0] % ROW_BLOCK == 0:
        return leading[0] // ROW_BLOCK
    if len(leading) != 1 or leading[0] not in ("T", "L"):
        raise BackendError(
            f"tvm: {node.op} lowers rows of a token- or logits-indexed tensor only, got "
            f"{node.inputs[0].type.text() if node.inputs[0] else '?'}: {node.describe()}"
        )
    return lw.dims["tq" if leading[0] == "T" else "lq"]


def rows_of(lw: Lowerer, node: Node, x: relax.Expr, last: int) -> tuple[relax.Expr, Any]:
    """x[..., last] viewed as [q, 4, last] (`row_blocks`)."""
    blocks = row_blocks(lw, node)
    return lw.emit(relax.op.reshape(x, [blocks, ROW_BLOCK, last])), blocks
