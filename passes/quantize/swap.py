"""Phase 2 of quantization: each eligible linear becomes a quantized_linear over the quantized weight,
each moe a quantized_moe over its quantized experts, and (gguf) an embedding whose table is GGUF
blocks a quantized_embedding over them. Routers stay float: top-k is discontinuous,
and a quantized router's noise would swap experts for a small saving (E x hidden values)."""

from __future__ import annotations

import numpy as np
import torch

from kiln.ir import Node, Program, Value, ValueKind
from kiln.ir.deferred import Deferred, Weight, reshaped
from kiln.ir.ops.moe import PROJECTIONS
from kiln.passes.base import Pass, PassError, PassOptions
from kiln.passes.quantize.gguf_encode import row_bytes
from kiln.passes.quantize.quantizers import (
    QuantizedWeight,
    deferred_quantized,
    import_gguf,
    quantize_int4,
    quantize_int8,
)
from kiln.passes.rewriter import Rewriter


def _embedding_weights(program: Program) -> set[str]:
    return {n.inputs[0].name for n in program.graph.nodes if n.op == "embedding" and n.inputs[0] is not None}


def _is_lm_head(node: Node, embedding_weights: set[str]) -> bool:
    weight = node.inputs[1]
    assert weight is not None
    return weight.name in embedding_weights or weight.name.startswith("lm_head")


def _routers(program: Program) -> set[str]:
    return {n.inputs[1].name for n in program.graph.nodes if n.op == "moe" and n.inputs[1] is not None}


def _quantized_weight(name: str, tensor: Weight, options: PassOptions) -> QuantizedWeight | None:
    """The weight quantized as `options` asks (None: it stays float): deferred where its values are
    (GGUF blocks always are), so a compile imports each weight when the artifact is written."""
    rows, k = tensor.shape
    if options.quantization == "int4" and k % options.group_size:
        raise PassError(
            f"weight {name}: in_features {k} is not a multiple of group size {options.group_size}",
            hint="choose a group size that divides it (32, 64 or 128), or int8",
        )
    if options.quantization in ("int8", "int4"):
        group = options.group_size

        def quantize(values: torch.Tensor) -> QuantizedWeight:
            return quantize_int8(values) if options.quantization == "int8" else quantize_int4(values, group)

        if not isinstance(tensor, Deferred):
            return quantize(tensor)
        return deferred_quantized(lambda: quantize(tensor.materialize()), quantize(torch.zeros(1, k)), rows)
    blocks = options.gguf_blocks.get(name)
    if blocks is None:
        return None  # stored as float in the GGUF: it stays float
    empty_row = np.zeros((1, row_bytes(blocks.ggml_type, k)), dtype=np.uint8)  # the layout, without a read
    probe = import_gguf(blocks.ggml_type, empty_row, (1, k), name)
    return deferred_quantized(
        lambda: import_gguf(blocks.ggml_type, blocks.read(), (rows, k), name), probe, rows
    )


def _quantized_experts(name: str, tensor: Weight, options: PassOptions) -> QuantizedWeight | None:
    """Stacked experts [E, N, K] quantized as the [E * N, K] rows they are, then stacked again."""
    experts, rows, k = tensor.shape
    flat = _quantized_weight(name, reshaped(tensor, (experts * rows, k)), options)
    if flat is None:
        return None
    flat.qweight = reshaped(flat.qweight, (experts, rows, -1))
    flat.scales = reshaped(flat.scales, (experts, rows, -1))
    flat.zeros = None if flat.zeros is None else reshaped(flat.zeros, (experts, rows, -1))
    return flat


def _quantize_moe(node: Node, program: Program, options: PassOptions, rewriter: Rewriter) -> bool:
    """moe → quantized_moe when every projection's experts quantize (GGUF: all three are blocks)."""
    expert_values = node.inputs[2:5]
    if not all(v is not None and v.kind is ValueKind.PARAM for v in expert_values):
        return False
    quantized = [
        _quantized_experts(v.name, program.weights[v.name], options) for v in expert_values if v is not None
    ]
    if any(q is None for q in quantized):
        return False
    params: dict[str, list[Value | None]] = {"qweight": [], "scales": [], "zeros": []}
    attrs: dict[str, object] = dict(node.attrs)
    for value, part, weight in zip(expert_values, PROJECTIONS, quantized, strict=True):
        assert value is not None and weight is not None
        params["qweight"].append(rewriter.add_param(f"{value.name}.qweight", weight.qweight))
        params["scales"].append(rewriter.add_param(f"{value.name}.scales", weight.scales))
        zeros = weight.zeros
        params["zeros"].append(None if zeros is None else rewriter.add_param(f"{value.name}.zeros", zeros))
        attrs[part] = weight.attrs()
    inputs = [node.inputs[0], node.inputs[1], *params["qweight"], *params["scales"], *params["zeros"]]
    while inputs[-1] is None:
        inputs.pop()
    (out,) = rewriter.emit("quantized_moe", inputs, attrs, node.source)
    rewriter.replace(node.outputs[0], out)
    return True


def _embeds_quantized(node: Node, options: PassOptions) -> bool:
    """An embedding whose table the GGUF holds as blocks gathers from them (only the rows it reads are
    dequantized), when the program stays float32 (its output is float32)."""
    table = node.inputs[0]
    return (
        node.op == "embedding"
        and options.quantization == "gguf"
        and options.dtype == "f32"
        and table is not None
        and table.kind is ValueKind.PARAM
        and table.name in options.gguf_blocks
    )


def quantizable_weights(program: Program) -> set[str]:
    """The weights the gguf import would take from `program`: linears' (routers stay float), stacked
    experts' and embedding tables' (the LM head is a linear, or the tied table)."""
    routers = _routers(program)
    names = set()
    for node in program.graph.nodes:
        if node.op == "linear" and node.outputs[0].name not in routers:
            weights = [node.inputs[1]]
        elif node.op == "moe":
            weights = list(node.inputs[2:5])
        elif node.op == "embedding":
            weights = [node.inputs[0]]
        else:
            continue
        names |= {w.name for w in weights if w is not None and w.kind is ValueKind.PARAM}
    return names


class _QuantizedParams:
    """Each weight's quantized params, added once: a tied table's embedding and LM head share them."""

    def __init__(self, program: Program, options: PassOptions, rewriter: Rewriter) -> None:
        self.program, self.options, self.rewriter = program, options, rewriter
        self.added: dict[str, tuple[list[Value | None], dict[str, int | str]] | None] = {}

    def of(self, weight: Value) -> tuple[list[Value | None], dict[str, int | str]] | None:
        """[qweight, scales, zeros or None] and the layout's attrs (None: the weight stays float)."""
        if weight.name not in self.added:
            quantized = _quantized_weight(weight.name, self.program.weights[weight.name], self.options)
            if quantized is None:
                self.added[weight.name] = None
            else:
                add = self.rewriter.add_param
                zeros = quantized.zeros
                params: list[Value | None] = [
                    add(f"{weight.name}.qweight", quantized.qweight),
                    add(f"{weight.name}.scales", quantized.scales),
                    None if zeros is None else add(f"{weight.name}.zeros", zeros),
                ]
                self.added[weight.name] = (params, quantized.attrs())
        return self.added[weight.name]


def quantize_linears(program: Program, options: PassOptions) -> tuple[Program, bool]:
    if options.quantization is None:
        return program, False
    if options.quantization == "gguf" and not options.gguf_blocks:
        raise PassError("quantization gguf needs a GGUF model with quantized blocks", hint="use int8 or int4")
    embedding_weights = _embedding_weights(program)
    routers = _routers(program)
    rewriter = Rewriter(program)
    quantized_params = _QuantizedParams(program, options, rewriter)
    for node in program.graph.nodes:
        if node.op == "moe":
            if not _quantize_moe(node, program, options, rewriter):
                rewriter.keep(node)
            continue
        if _embeds_quantized(node, options):
            table = node.inputs[0]
            assert table is not None
            found = quantized_params.of(table)
            if found is None:
                rewriter.keep(node)
                continue
            params, attrs = found
            inputs = [node.inputs[1], *params]
            while inputs[-1] is None:
                inputs.pop()
            (out,) = rewriter.emit("quantized_embedding", inputs, attrs, node.source)
            rewriter.replace(node.outputs[0], out)
            continue
        weight = node.inputs[1] if node.op == "linear" else None
        eligible = (
            weight is not None
            and weight.kind is ValueKind.PARAM
            and node.outputs[0].name not in routers
            and (options.quantize_lm_head or not _is_lm_head(node, embedding_weights))
        )
        found = quantized_params.of(weight) if eligible and weight is not None else None
        if found is None:
            rewriter.keep(node)
            continue
        params, attrs = found
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        inputs = [node.inputs[0], *params, bias]
        while inputs[-1] is None:
            inputs.pop()
        (out,) = rewriter.emit("quantized_linear", inputs, attrs, node.source)
        rewriter.replace(node.outputs[0], out)
    return rewriter.finish(), rewriter.changed


QUANTIZE_LINEARS = Pass(
    "quantize_linears",
    quantize_linears,
    "linear → quantized_linear, moe → quantized_moe (int8, int4, gguf), embedding → quantized_embedding "
    "(gguf)",
)
