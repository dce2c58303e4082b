"""A step's arithmetic, counted from the graph: 2 FLOPs per multiply-add in matmuls and attention."""

from __future__ import annotations

from kiln.ir import Graph
from kiln.ir.types import Dim


def _size(dim: Dim, sizes: dict[str, int]) -> int:
    return dim if isinstance(dim, int) else sizes[dim]


def matmul_flops(graph: Graph, sizes: dict[str, int], context: int) -> int:
    """Linear layers (float or quantized) and attention over `context` keys per query row; the
    elementwise ops, a small fraction, are not counted."""
    total = 0
    for node in graph.nodes:
        out = node.outputs[0].type
        if node.op in ("linear", "quantized_linear"):
            x = node.inputs[0]
            assert x is not None
            rows = 1
            for dim in out.shape[:-1]:
                rows *= _size(dim, sizes)
            total += 2 * rows * _size(x.type.shape[-1], sizes) * _size(out.shape[-1], sizes)
        elif node.op in ("moe", "quantized_moe"):  # top_k experts a token, three matmuls each
            x = node.inputs[0]
            assert x is not None
            tokens, hidden = (_size(d, sizes) for d in x.type.shape)
            gate = node.inputs[2]
            assert gate is not None
            inner = _size(gate.type.shape[1], sizes)
            total += 2 * tokens * int(node.attrs["top_k"]) * 3 * hidden * inner
        elif node.op == "paged_attention":
            tokens, heads, head_dim = (_size(d, sizes) for d in out.shape)
            total += 2 * 2 * tokens * heads * head_dim * context  # scores and the weighted sum
    return total
