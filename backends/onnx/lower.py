"""IR graph (+ program weights) → one ONNX model for the whole step. Weights become graph inputs,
bound from the artifact's weights at load time (see weights.py); each layer's new K/V rows become a
graph output (see ops_attention.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import onnx
from onnx import helper

from kiln.backends.base import BackendError
from kiln.backends.onnx import (  # noqa: F401  (register the rules)
    ops_attention,
    ops_basic,
    ops_lora,
    ops_moe,
    ops_quant,
    ops_vision,
)
from kiln.backends.onnx.builder import CONTRIB_DOMAIN, ONNX_DTYPES
from kiln.backends.onnx.context import LoweringContext, LoweringOptions
from kiln.backends.onnx.rules import RULES, Rule
from kiln.backends.onnx.weights import WeightBinding
from kiln.ir import KV_CACHE_INPUT, Node, Program, TensorType

KV_OUTPUT = "kv_new"  # [layers, 2, T, kv_heads, head_dim]: the rows the executable writes at slot_mapping
IR_VERSION = 10  # what ONNX Runtime 1.20+ and TensorRT 10 read


@dataclass
class LoweredModel:
    model: onnx.ModelProto
    bindings: list[WeightBinding]
    kernels: dict[str, str]  # IR op → the ONNX kernel it became
    outputs: list[str]  # the IR graph's outputs (logits), by ONNX name
    kv_layers: list[int] = field(default_factory=list)  # the layers of KV_OUTPUT, in order

    def meta(self) -> dict[str, object]:
        return {
            "outputs": self.outputs,
            "kv_output": KV_OUTPUT if self.kv_layers else None,
            "kv_layers": self.kv_layers,
            "bindings": [b.to_json() for b in self.bindings],
        }


def lowering_error(node: Node, reason: str) -> BackendError:
    where = f" at {node.source}" if node.source else ""
    outs = ", ".join(v.ref() for v in node.outputs)
    ins = ", ".join(v.ref() if v else "none" for v in node.inputs)
    return BackendError(
        f"cannot lower IR node `{outs} = {node.op}({ins})` (op {node.op}){where} to ONNX: {reason}",
        hint="the ONNX lowering has no rule for it: add one in backends/onnx/ or use the reference backend",
    )


def check_lowerable(program: Program, options: LoweringOptions, rules: Mapping[str, Rule] = RULES) -> None:
    """Raise a BackendError naming the first node (op and model line) the lowering cannot take."""
    for node in program.graph.nodes:
        found = rules.get(node.op)
        if found is None:
            raise lowering_error(node, "no lowering rule for this op")
        reason = found.check(node, options) if found.check is not None else None
        if reason is not None:
            raise lowering_error(node, reason)


def _value_info(name: str, type_: TensorType | tuple[str, list[int | str]]) -> onnx.ValueInfoProto:
    dtype, shape = (type_.dtype, list(type_.shape)) if isinstance(type_, TensorType) else type_
    return helper.make_tensor_value_info(name, ONNX_DTYPES[dtype], shape)


def _kv_output(ctx: LoweringContext) -> tuple[list[int], list[onnx.ValueInfoProto]]:
    if not ctx.kv_outputs:
        return [], []
    cache = ctx.graph.input(KV_CACHE_INPUT).type
    layers = sorted(ctx.kv_outputs)
    if layers != list(range(int(cache.shape[0]))):
        raise BackendError(
            f"the graph's attention layers {layers} do not cover the cache's {cache.shape[0]} layers "
            "once each"
        )
    b, stacked = ctx.b, []
    for layer in layers:
        k, v = ctx.kv_outputs[layer]
        pair = [b.op("Unsqueeze", x, b.const([0, 1])) for x in (k, v)]
        stacked.append(b.op("Concat", *pair, axis=1))
    b.node("Concat", stacked, [KV_OUTPUT], axis=0)
    shape: list[int | str] = [len(layers), 2, "T", int(cache.shape[4]), int(cache.shape[5])]
    return layers, [_value_info(KV_OUTPUT, (cache.dtype, shape))]


def lower_program(
    program: Program, options: LoweringOptions | None = None, rules: Mapping[str, Rule] = RULES
) -> LoweredModel:
    options = options or LoweringOptions()
    check_lowerable(program, options, rules)
    graph = program.graph
    ctx = LoweringContext(graph, program.weights, options)
    kernels: dict[str, str] = {}
    for node in graph.nodes:
        outputs = [ctx.name(v) for v in node.outputs]
        try:
            kernels[node.op] = rules[node.op].lower(ctx, node, outputs)
        except (KeyError, ValueError, TypeError, AssertionError) as error:
            raise lowering_error(node, f"{type(error).__name__}: {error}") from error
    kv_layers, kv_infos = _kv_output(ctx)
    outputs = [ctx.name(v) for v in graph.outputs]
    onnx_graph = helper.make_graph(
        ctx.b.nodes,
        graph.name,
        [_value_info(v.name, v.type) for v in graph.inputs]
        + [_value_info(w.name, (w.dtype, list(w.shape))) for w in ctx.bindings.values()],
        [_value_info(name, v.type) for name, v in zip(outputs, graph.outputs, strict=True)] + kv_infos,
        initializer=ctx.b.constants,
    )
    opsets = [helper.make_opsetid("", options.opset)]
    if CONTRIB_DOMAIN in ctx.b.domains:
        opsets.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
    model = helper.make_model(onnx_graph, opset_imports=opsets, producer_name="kiln", ir_version=IR_VERSION)
    return LoweredModel(model, list(ctx.bindings.values()), kernels, outputs, kv_layers)
