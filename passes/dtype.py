"""Run in float16 or bfloat16: float weights, activations and the KV cache take the dtype; linear
layers accumulate in float32 (their reference upcasts); the logits come out in float32."""

from __future__ import annotations

from kiln.ir import DTYPES, KV_CACHE_INPUT, Graph, Program, TensorType, Value
from kiln.ir.builder import GraphBuilder
from kiln.ir.types import FLOAT_DTYPES
from kiln.passes.base import Pass, PassOptions

# quantization scales keep their precision: they are small and GGUF's must stay exact
_KEEP = (".scales", ".zeros")


def convert_dtype(program: Program, options: PassOptions) -> tuple[Program, bool]:
    dtype = options.dtype
    if dtype == "f32":
        return program, False
    graph = program.graph
    builder = GraphBuilder(graph.name)
    mapping: dict[str, Value] = {}
    for value in graph.inputs:
        type_ = value.type
        if value.name == KV_CACHE_INPUT:
            type_ = TensorType(dtype, type_.shape)
        mapping[value.name] = builder.input(value.name, type_)
    weights = dict(program.weights)
    for param in graph.params:
        if param.type.dtype in FLOAT_DTYPES and not param.name.endswith(_KEEP):
            weights[param.name] = weights[param.name].to(DTYPES[dtype])
        mapping[param.name] = builder.param(param.name, TensorType.of(weights[param.name]))
    for node in graph.nodes:
        inputs = [mapping[v.name] if v is not None else None for v in node.inputs]
        outputs = builder.op(node.op, inputs, attrs=node.attrs, source=node.source)
        mapping.update({old.name: new for old, new in zip(node.outputs, outputs, strict=True)})
    results = []
    for value in graph.outputs:
        result = mapping[value.name]
        if result.type.dtype != "f32" and result.type.dtype in FLOAT_DTYPES:
            result = builder.op1("cast", [result], attrs={"dtype": "f32"})
        results.append(result)
    new_graph: Graph = builder.build(results)
    return Program(new_graph, {p.name: weights[p.name] for p in new_graph.params}), True


CONVERT_DTYPE = Pass("convert_dtype", convert_dtype, "float16 / bfloat16 weights, activations and KV cache")
