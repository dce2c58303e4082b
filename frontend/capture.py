"""torch.fx capture of a model's step into the Kiln IR.

Translation dispatches on the fx opcode, keeps an `env` from fx nodes to IR values, and maps each
call target through one table. A target with no entry fails naming the node, its target and the
model source line it came from.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from kiln.errors import KilnError, ModelLoadError
from kiln.frontend.config import ModelConfig
from kiln.frontend.models import model_class
from kiln.frontend.models.step import StepTensors
from kiln.frontend.ops import WRAPPED_OPS
from kiln.ir import (
    KV_CACHE_INPUT,
    STEP_INPUT_TYPES,
    Graph,
    GraphBuilder,
    TensorType,
    Value,
    kv_cache_type,
    verify,
)
from kiln.ir.deferred import Deferred, Weight, meta

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in \w+\n\s*(.*)')


class CaptureError(KilnError):
    """A model's fx graph holds something the IR has no op for."""


@dataclass
class CapturedModel:
    graph: Graph
    weights: dict[str, Weight]
    config: ModelConfig


def build_model(config: ModelConfig, weights: dict[str, Weight]) -> nn.Module:
    """The torch.nn definition for `config`, holding `weights` (HF names) without copying them; a
    deferred weight is held as a meta tensor (capture needs its shape and dtype only)."""
    with torch.device("meta"):
        model = model_class(config)(config)
    expected = set(model.state_dict())
    given = {name: w for name, w in weights.items() if name in expected}
    missing = sorted(expected - set(given))
    if missing:
        raise ModelLoadError(
            f"the weights lack {len(missing)} tensors that {config.architecture} needs, e.g. {missing[0]}",
            hint="is the checkpoint complete and of this architecture?",
        )
    for name, tensor in given.items():
        want = tuple(model.get_parameter(name).shape)
        if tuple(tensor.shape) != want:
            raise ModelLoadError(
                f"weight {name} has shape {list(tensor.shape)}, the config implies {list(want)}"
            )
    stand_ins = {name: meta(w) if isinstance(w, Deferred) else w for name, w in given.items()}
    model.load_state_dict(stand_ins, strict=True, assign=True)
    return model.eval()


def source_line(node: fx.Node) -> str | None:
    """`file.py:LINE code` for the innermost model frame that made this node (paths kept relative)."""
    frames = [f for f in _FRAME.findall(node.stack_trace or "") if "site-packages" not in f[0]]
    if not frames:
        return None
    path, line, code = frames[-1]
    try:
        shown = str(Path(path).resolve().relative_to(_PACKAGE_ROOT))
    except ValueError:
        shown = Path(path).name
    return f"{shown}:{line} {code.strip()}"


class _Translator:
    def __init__(self, model: nn.Module, input_types: dict[str, TensorType], name: str) -> None:
        self.model = model
        self.input_types = input_types
        self.builder = GraphBuilder(name)
        self.env: dict[fx.Node, Value] = {}
        self.source: str | None = None

    def value(self, arg: Any) -> Value | None:
        if arg is None:
            return None
        if not isinstance(arg, fx.Node):
            raise CaptureError(f"expected a tensor, got the constant {arg!r}")
        return self.env[arg]

    def emit(self, op: str, inputs: list[Value | None], attrs: dict[str, Any] | None = None) -> Value:
        return self.builder.op1(op, inputs, attrs=attrs, source=self.source)

    def placeholder(self, node: fx.Node) -> Value:
        name = str(node.target)
        if name not in self.input_types:
            raise CaptureError(
                f"the module has an input {name!r} that the input spec lacks",
                hint=f"the spec names {', '.join(self.input_types)}",
            )
        return self.builder.input(name, self.input_types[name])

    def get_attr(self, node: fx.Node) -> Value:
        tensor = self.model.get_parameter(str(node.target))
        return self.builder.param(str(node.target), TensorType.of(tensor))

    def unsupported(self, node: fx.Node) -> CaptureError:
        where = f" at {self.source}" if self.source else ""
        target = getattr(node.target, "__name__", node.target)
        return CaptureError(
            f"cannot capture fx node `{node.format_node()}` (op {node.op}, target {target}){where}",
            hint="the IR has no op for it: rewrite the model line with supported ops or register an IR op",
        )

    def translate(self, graph: fx.Graph) -> Graph:
        outputs: list[Value] = []
        for node in graph.nodes:
            self.source = source_line(node)
            if node.op == "placeholder":
                self.env[node] = self.placeholder(node)
            elif node.op == "get_attr":
                self.env[node] = self.get_attr(node)
            elif node.op == "call_function":
                handler = _FUNCTIONS.get(node.target)  # type: ignore[arg-type]
                if handler is None:
                    raise self.unsupported(node)
                self.env[node] = self.call(handler, node)
            elif node.op == "call_method":
                handler = _METHODS.get(str(node.target))
                if handler is None:
                    raise self.unsupported(node)
                self.env[node] = self.call(handler, node)
            elif node.op == "output":
                result = node.args[0]
                outputs = [self.env[n] for n in (result if isinstance(result, tuple | list) else [result])]
            else:
                raise self.unsupported(node)
        return self.builder.build(outputs)

    def call(self, handler: Callable[[_Translator, fx.Node], Value], node: fx.Node) -> Value:
        try:
            return handler(self, node)
        except KilnError as err:
            if isinstance(err, CaptureError) and "cannot capture" in str(err):
                raise
            raise CaptureError(f"cannot capture fx node `{node.format_node()}`: {err}") from err


def _wrapped(op_name: str) -> Callable[[_Translator, fx.Node], Value]:
    def handle(t: _Translator, node: fx.Node) -> Value:
        return t.emit(op_name, [t.value(a) for a in node.args], dict(node.kwargs))

    return handle


def _linear(t: _Translator, node: fx.Node) -> Value:
    args = list(node.args) + [node.kwargs.get("bias")] * (3 - len(node.args))
    inputs = [t.value(args[0]), t.value(args[1])]
    bias = t.value(args[2])
    return t.emit("linear", inputs + ([bias] if bias is not None else []))


def _embedding(t: _Translator, node: fx.Node) -> Value:
    ids, weight = node.args[0], node.args[1]
    return t.emit("embedding", [t.value(weight), t.value(ids)])


def _binary(op_name: str) -> Callable[[_Translator, fx.Node], Value]:
    return lambda t, node: t.emit(op_name, [t.value(node.args[0]), t.value(node.args[1])])


def _index_select(t: _Translator, node: fx.Node) -> Value:
    x, dim, index = node.args
    if dim != 0:
        raise CaptureError(f"index_select along dim {dim}; only dim 0 is supported")
    return t.emit("take_rows", [t.value(x), t.value(index)])


def _reshape(t: _Translator, node: fx.Node) -> Value:
    dims = node.args[1:]
    if len(dims) == 1 and isinstance(dims[0], tuple | list):
        dims = tuple(dims[0])
    if not all(isinstance(d, int) for d in dims):
        raise CaptureError(f"reshape to {dims}: only constant dims and -1 are supported")
    return t.emit("reshape", [t.value(node.args[0])], {"shape": list(dims)})


def _transpose(t: _Translator, node: fx.Node) -> Value:
    """`x.t()`, `x.transpose(a, b)`, `torch.transpose(x, a, b)`: two dims swapped."""
    x = t.value(node.args[0])
    rank = x.type.rank
    first, second = node.args[1:3] if len(node.args) == 3 else (0, 1)
    if not (isinstance(first, int) and isinstance(second, int)):
        raise CaptureError(f"transpose of dims {first}, {second}: only constant dims are supported")
    perm = list(range(rank))
    perm[first % rank], perm[second % rank] = perm[second % rank], perm[first % rank]
    return t.emit("transpose", [x], {"perm": perm})


_FUNCTIONS: dict[Any, Callable[[_Translator, fx.Node], Value]] = {
    F.linear: _linear,
    F.embedding: _embedding,
    F.silu: lambda t, node: t.emit("silu", [t.value(node.args[0])]),
    operator.add: _binary("add"),
    operator.mul: _binary("mul"),
    torch.add: _binary("add"),
    torch.mul: _binary("mul"),
    torch.index_select: _index_select,
    torch.transpose: _transpose,
    **{fn: _wrapped(op_name) for fn, op_name in WRAPPED_OPS.items()},
}
_METHODS: dict[str, Callable[[_Translator, fx.Node], Value]] = {
    "view": _reshape,
    "reshape": _reshape,
    "t": _transpose,
    "transpose": _transpose,
}


class _StepTracer(fx.Tracer):
    """Traces a step's `forward(step)`: one placeholder an input, in the order given, gathered into
    the one StepTensors value the model code passes down."""

    def __init__(self, input_names: list[str]) -> None:
        super().__init__(autowrap_functions=tuple(WRAPPED_OPS))
        self.input_names = input_names

    def create_args_for_root(
        self, root_fn: Callable[..., Any], is_module: bool, concrete_args: Any = None
    ) -> tuple[Any, list[Any]]:
        named = {name: self.create_proxy("placeholder", name, (), {}) for name in self.input_names}
        return root_fn, [self.root, StepTensors.of(named)]


def trace(model: nn.Module, step_inputs: list[str] | None = None) -> fx.Graph:
    """`model.forward`'s fx graph: its arguments as they are named, or with `step_inputs`, one
    StepTensors of those inputs."""
    tracer = (
        fx.Tracer(autowrap_functions=tuple(WRAPPED_OPS)) if step_inputs is None else _StepTracer(step_inputs)
    )
    tracer.record_stack_traces = True
    return tracer.trace(model)


def capture_module(
    module: nn.Module, input_types: dict[str, TensorType], name: str, step: bool = False
) -> Graph:
    """The verified IR graph of `module.forward`, whose arguments are typed by `input_types` (with
    `step`, its one argument a StepTensors of those inputs)."""
    traced = trace(module, list(input_types) if step else None)
    graph = _Translator(module, input_types, name).translate(traced)
    verify(graph)
    return graph


def step_input_types(config: ModelConfig) -> dict[str, TensorType]:
    """The step's inputs: the contract's, the KV cache shaped for `config`, then the optional ones the
    model's definition takes for it (its `optional_inputs`)."""
    cache = kv_cache_type(config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    optional = model_class(config).optional_inputs(config)  # type: ignore[attr-defined]
    return {**STEP_INPUT_TYPES, KV_CACHE_INPUT: cache, **optional}


def capture(model: nn.Module, config: ModelConfig, name: str = "step") -> Graph:
    """The IR graph of `model`'s step, verified."""
    return capture_module(model, step_input_types(config), name, step=True)


def capture_weights(config: ModelConfig, weights: dict[str, Weight], name: str = "step") -> CapturedModel:
    """Build the model for `config` over `weights` and capture it; weights are those the graph names."""
    model = build_model(config, weights)
    graph = capture(model, config, name)
    used = {p.name: weights[p.name] for p in graph.params}
    return CapturedModel(graph, used, config)
