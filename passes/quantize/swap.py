"""Phase 2 of quantization: each eligible linear becomes a quantized_linear over the quantized weight."""

from __future__ import annotations

from kiln.ir import Node, Program, ValueKind
from kiln.passes.base import Pass, PassError, PassOptions
from kiln.passes.quantize.quantizers import QuantizedWeight, import_gguf, quantize_int4, quantize_int8
from kiln.passes.rewriter import Rewriter


def _embedding_weights(program: Program) -> set[str]:
    return {n.inputs[0].name for n in program.graph.nodes if n.op == "embedding" and n.inputs[0] is not None}


def _is_lm_head(node: Node, embedding_weights: set[str]) -> bool:
    weight = node.inputs[1]
    assert weight is not None
    return weight.name in embedding_weights or weight.name.startswith("lm_head")


def _quantized(node: Node, program: Program, options: PassOptions) -> QuantizedWeight | None:
    weight = node.inputs[1]
    assert weight is not None
    tensor = program.weights[weight.name]
    rows, k = tensor.shape
    if options.quantization == "int8":
        return quantize_int8(tensor)
    if options.quantization == "int4":
        if k % options.group_size:
            raise PassError(
                f"weight {weight.name}: in_features {k} is not a multiple of group size {options.group_size}",
                hint="choose a group size that divides it (32, 64 or 128), or int8",
            )
        return quantize_int4(tensor, options.group_size)
    blocks = options.gguf_blocks.get(weight.name)
    if blocks is None:
        return None  # stored as float in the GGUF: it stays float
    return import_gguf(blocks[0], blocks[1], (rows, k), weight.name)


def quantize_linears(program: Program, options: PassOptions) -> tuple[Program, bool]:
    if options.quantization is None:
        return program, False
    if options.quantization == "gguf" and not options.gguf_blocks:
        raise PassError("quantization gguf needs a GGUF model with quantized blocks", hint="use int8 or int4")
    embedding_weights = _embedding_weights(program)
    rewriter = Rewriter(program)
    for node in program.graph.nodes:
        weight = node.inputs[1] if node.op == "linear" else None
        eligible = (
            weight is not None
            and weight.kind is ValueKind.PARAM
            and (options.quantize_lm_head or not _is_lm_head(node, embedding_weights))
        )
        quantized = _quantized(node, program, options) if eligible else None
        if quantized is None:
            rewriter.keep(node)
            continue
        assert weight is not None
        qweight = rewriter.add_param(f"{weight.name}.qweight", quantized.qweight)
        scales = rewriter.add_param(f"{weight.name}.scales", quantized.scales)
        zeros = (
            rewriter.add_param(f"{weight.name}.zeros", quantized.zeros)
            if quantized.zeros is not None
            else None
        )
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        inputs = [node.inputs[0], qweight, scales, zeros, bias]
        while inputs[-1] is None:
            inputs.pop()
        (out,) = rewriter.emit("quantized_linear", inputs, quantized.attrs(), node.source)
        rewriter.replace(node.outputs[0], out)
    return rewriter.finish(), rewriter.changed


QUANTIZE_LINEARS = Pass("quantize_linears", quantize_linears, "linear → quantized_linear (int8, int4, gguf)")
