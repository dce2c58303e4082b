"""quantized_linear → com.microsoft MatMulNBits (operands repacked at load time), or a float Gemm;
quantized_embedding → a Gather from the table dequantized at load.

MatMulNBits computes x @ (scale * (q - zero_point)).T with q unsigned, in blocks of a power of two
(16..128 here) along K. Every kiln layout maps onto it: 4-bit "gguf" packing is repacked to
MatMulNBits' low-nibble-first pairs, signed int8 is shifted by 128 (zero point 128), a group larger
than a block repeats its scale (and zero point) over the blocks it spans.

Zero points are always uint8: with float zero points ONNX Runtime 1.32's CPU kernel leaves its packed
fast path (measured 15.7 ms vs 0.54 ms for a 1 x 576 x 3072 product). A layout whose offset is not a
level — GGUF Q4_1's `scale * q + min`, our int4's float zero point z (min = -scale * z) — runs as
MatMulNBits with zero point 0 plus the exact offset term: x @ min-expanded.T = (x summed per group)
@ mins.T, a [T, K/group] x [K/group, N] Gemm.
Without contrib ops (TensorRT), or for a group size no block divides, the weight is dequantized at
load time and multiplied with Gemm.
"""

from __future__ import annotations

from kiln.backends.onnx.context import LoweringContext, LoweringOptions
from kiln.backends.onnx.ops_basic import matmul_2d
from kiln.backends.onnx.rules import rule
from kiln.backends.onnx.weights import WeightBinding, integral_zero_points
from kiln.ir import Node, Value

BLOCK_SIZES = (128, 64, 32, 16)
# 8-bit MatMulNBits has no packed fp32 path on the CPU in ONNX Runtime 1.32: it dequantizes the whole
# weight per call (465 ms for the 49152 x 576 LM head vs 17 ms as a float Gemm), so 8-bit weights are
# dequantized once at load and run as Gemm (4x their memory, exact).
NBITS_BITS = (4,)
# 0: float32 arithmetic, as the reference. 4 (int8 activations) is ~10x faster on one row but rounds x.
ACCURACY_LEVEL = 0


def nbits_block(group_size: int, k: int) -> int | None:
    """The MatMulNBits block for a group size: the largest power of two dividing it (up to 128)."""
    return next((block for block in BLOCK_SIZES if group_size % block == 0 and k % block == 0), None)


def _layout(node: Node) -> dict[str, int | str]:
    return {key: node.attrs[key] for key in ("bits", "group_size", "scheme", "packing")}  # type: ignore[misc]


def _sources(node: Node) -> tuple[Value, list[str]]:
    qweight, scales = node.inputs[1], node.inputs[2]
    assert qweight is not None and scales is not None
    zeros = node.inputs[3] if len(node.inputs) > 3 else None
    return qweight, [v.name for v in (qweight, scales, zeros) if v is not None]


def _check(node: Node, options: LoweringOptions) -> str | None:
    x = node.inputs[0]
    if x is None or x.type.dtype not in ("f32", "f16"):
        return "only float32 and float16 activations are lowered"
    return None


@rule("quantized_linear", _check)
def _quantized_linear(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    x = node.inputs[0]
    assert x is not None
    layout = _layout(node)
    qweight, sources = _sources(node)
    n, k = int(qweight.type.shape[0]), int(x.type.shape[-1])
    group = int(layout["group_size"])
    bias = node.inputs[4] if len(node.inputs) > 4 else None
    bias_name = ctx.name(bias) if bias is not None else None
    block = nbits_block(group, k)
    base = qweight.name.removesuffix(".qweight")

    bits = int(layout["bits"])
    if ctx.options.contrib_ops and block is not None and bits in NBITS_BITS:
        attrs = {**layout, "block_size": block}
        blocks = k // block
        q = ctx.bind(
            WeightBinding(
                f"{base}.nbits_q", "nbits_qweight", [sources[0]], "u8", [n, blocks, block * bits // 8], attrs
            )
        )
        scales = ctx.bind(
            WeightBinding(f"{base}.nbits_scales", "nbits_scales", sources, x.type.dtype, [n * blocks], attrs)
        )
        zero_tensor = ctx.weights.get(sources[2]) if len(sources) > 2 else None
        integral = integral_zero_points(str(layout["scheme"]), bits, zero_tensor)
        attrs = {**attrs, "k": k, "integral": integral}
        zeros = ctx.bind(
            WeightBinding(
                f"{base}.nbits_zeros", "nbits_zeros", sources, "u8", [n * -(-blocks * bits // 8)], attrs
            )
        )
        mins = None
        if not integral:
            mins = ctx.bind(
                WeightBinding(
                    f"{base}.nbits_mins", "nbits_mins", sources, x.type.dtype, [n, k // group], attrs
                )
            )

        def nbits(rows: str, outs: list[str] | int) -> str:
            terms = [
                ctx.b.op(
                    "MatMulNBits",
                    rows,
                    q,
                    scales,
                    zeros,
                    domain="com.microsoft",
                    K=k,
                    N=n,
                    bits=bits,
                    block_size=block,
                    accuracy_level=ACCURACY_LEVEL,
                )
            ]
            if mins is not None:  # + (x summed per group) @ mins.T
                grouped = ctx.b.op("Reshape", rows, ctx.b.const([0, k // group, group]))
                sums = ctx.b.op("ReduceSum", grouped, ctx.b.const([-1]), keepdims=0)
                terms.append(ctx.b.op("Gemm", sums, mins, transB=1))
            if bias_name is not None:
                terms.append(bias_name)
            if len(terms) == 1:
                (out,) = ctx.b.node("Identity", terms, outs)
                return out
            total = terms[0]
            for term in terms[1:-1]:
                total = ctx.b.op("Add", total, term)
            (out,) = ctx.b.node("Add", [total, terms[-1]], outs)
            return out

        matmul_2d(ctx, x, nbits, outputs)
        return "com.microsoft.MatMulNBits" if mins is None else "com.microsoft.MatMulNBits + group-sum Gemm"

    weight = ctx.bind(
        WeightBinding(f"{base}.dequantized", "dequantized", sources, x.type.dtype, [n, k], layout)
    )

    def gemm(rows: str, outs: list[str] | int) -> str:
        inputs = [rows, weight] + ([bias_name] if bias_name is not None else [])
        (out,) = ctx.b.node("Gemm", inputs, outs, transB=1)
        return out

    matmul_2d(ctx, x, gemm, outputs)
    return "onnx Gemm (weight dequantized at load)"


@rule("quantized_embedding")
def _quantized_embedding(ctx: LoweringContext, node: Node, outputs: list[str]) -> str:
    """The table dequantized once at load, then a Gather (ONNX has no gather of packed rows)."""
    ids = node.inputs[0]
    assert ids is not None
    layout = _layout(node)
    qweight, sources = _sources(node)  # qweight, scales, zeros sit where quantized_linear has them
    vocab, k = int(qweight.type.shape[0]), int(node.outputs[0].type.shape[-1])
    base = qweight.name.removesuffix(".qweight")
    table = ctx.bind(WeightBinding(f"{base}.dequantized", "dequantized", sources, "f32", [vocab, k], layout))
    ctx.b.node("Gather", [table, ctx.name(ids)], outputs, axis=0)
    return "onnx Gather (table dequantized at load)"
