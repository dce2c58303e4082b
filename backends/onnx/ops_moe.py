"""moe and quantized_moe lowered to standard ONNX: route, gather the chosen experts, batched SwiGLU.

    probs        = Softmax(router_logits as float32)
    weights, ids = TopK(probs, top_k)                     [T, k]; / ReduceSum(weights) if `normalize`
    W            = Gather(stacked experts, ids, axis 0)   [T, k, N, K]: only the selected experts
    out          = ReduceSum_k(weights * down_W @ (silu(gate_W @ x) * (up_W @ x)))

Each token's row is a column vector [T, 1, H, 1], so the gathered [T, k, N, K] experts multiply it as
they are (no transpose). The Gather copies T * k expert matrices per step: at decode (T = 1) that is
the top_k experts a token reads anyway; a prefill copies one set per token, more than the E experts'
bytes once T * k > E. Acceptable for now; grouping tokens by expert would need data-dependent shapes.

quantized_moe dequantizes each projection's stacked experts once at load time (weights.py, kind
"dequantized", [E, N, K] at the activation dtype, float32 on the CPU) and then lowers exactly like
moe: the experts take 4-8x their quantized (GGUF) bytes in memory. MatMulNBits would keep them
packed, but it multiplies by one fixed weight: it has no batch of per-token experts to gather, and E
MatMulNBits over every token would compute all experts instead of the top_k.
"""

from __future__ import annotations

from kiln.backends.onnx.builder import ONNX_DTYPES
from kiln.backends.onnx.context import LoweringContext, LoweringOptions
from kiln.backends.onnx.ops_basic import silu
from kiln.backends.onnx.rules import rule
from kiln.backends.onnx.weights import WeightBinding
from kiln.ir import Node
from kiln.ir.ops.moe import PROJECTIONS, quantized_inputs

LAYOUT = ("bits", "group_size", "scheme", "packing")  # what the load-time dequantization reads


def _route(ctx: LoweringContext, node: Node, dtype: str) -> tuple[str, str]:
    """(weights [T, k] in `dtype`, expert ids [T, k] int64) as ir.ops.moe.route computes them."""
    b = ctx.b
    logits_value = node.inputs[1]
    assert logits_value is not None
    logits = ctx.name(logits_value)
    if logits_value.type.dtype != "f32":
        logits = b.op("Cast", logits, to=ONNX_DTYPES["f32"])
    probs = b.op("Softmax", logits, axis=-1)
    top_k = node.attrs["top_k"]
    assert isinstance(top_k, int)
    weights, ids = b.node("TopK", [probs, b.const([top_k])], 2, axis=-1, largest=1, sorted=1)
    if node.attrs["normalize"]:
        weights = b.op("Div", weights, b.op("ReduceSum", weights, b.const([-1]), keepdims=1))
    if dtype != "f32":
        weights = b.op("Cast", weights, to=ONNX_DTYPES[dtype])
    return weights, ids


def _experts(ctx: LoweringContext, node: Node, stacked: dict[str, str], outputs: list[str]) -> None:
    """outputs = the top-k SwiGLU experts of `stacked` (ONNX names of gate, up [E, I, H], down [E, H, I])
    applied to x [T, H]."""
    b = ctx.b
    x = node.inputs[0]
    assert x is not None
    weights, ids = _route(ctx, node, x.type.dtype)
    chosen = {name: b.op("Gather", stacked[name], ids, axis=0) for name in PROJECTIONS}  # [T, k, N, K]
    column = b.op("Unsqueeze", ctx.name(x), b.const([1, 3]))  # [T, 1, H, 1]
    gate = b.op("MatMul", chosen["gate"], column)  # [T, k, I, 1]
    up = b.op("MatMul", chosen["up"], column)
    hidden = b.op("Mul", silu(ctx, gate), up)
    down = b.op("Squeeze", b.op("MatMul", chosen["down"], hidden), b.const([3]))  # [T, k, H]
    weighted = b.op("Mul", down, b.op("Unsqueeze", weights, b.const([2])))
    b.node("ReduceSum", [weighted, b.const([1])], outputs, keepdims=0)


@rule("moe")
def _moe(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    stacked: dict[str, str] = {}
    for name, value in zip(PROJECTIONS, node.inputs[2:5], strict=True):
        assert value is not None
        stacked[name] = ctx.name(value)
    _experts(ctx, node, stacked, outputs)
    return "onnx Softmax, TopK, Gather (selected experts), MatMul"


def _check_quantized(node: Node, options: LoweringOptions) -> str | None:
    x = node.inputs[0]
    if x is None or x.type.dtype not in ("f32", "f16"):
        return "only float32 and float16 activations are lowered"
    return None


def _dequantized(ctx: LoweringContext, node: Node, projection: str) -> str:
    """The ONNX input bound at load to the projection's experts, dequantized: [E, N, K]."""
    x = node.inputs[0]
    layout = node.attrs[projection]
    qweight, scales, zeros = quantized_inputs(node.inputs)[projection]
    assert x is not None and isinstance(layout, dict) and qweight is not None and scales is not None
    sources = [v.name for v in (qweight, scales, zeros) if v is not None]
    experts, n, packed = (int(d) for d in qweight.type.shape)
    k = packed * 2 if layout["bits"] == 4 else packed
    attrs = {key: layout[key] for key in LAYOUT}
    name = f"{qweight.name.removesuffix('.qweight')}.dequantized"
    return ctx.bind(WeightBinding(name, "dequantized", sources, x.type.dtype, [experts, n, k], attrs))


@rule("quantized_moe", _check_quantized)
def _quantized_moe(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    stacked = {name: _dequantized(ctx, node, name) for name in PROJECTIONS}
    _experts(ctx, node, stacked, outputs)
    return "onnx Softmax, TopK, Gather (selected experts), MatMul (experts dequantized at load)"
