"""`kiln inspect MODEL --weights`: how the model file stores each tensor, and how the artifact would hold
each of its tensors after the pass pipeline (float dtype, or the quantized layout and GGUF block type)."""

from __future__ import annotations

from kiln.compiler.build import BuiltProgram
from kiln.frontend.source import QuantizedTensor
from kiln.ir import ValueKind
from kiln.ir.deferred import Deferred
from kiln.ir.types import DTYPE_OF_TORCH

QUANTIZED_OPS = ("quantized_linear", "quantized_moe", "quantized_embedding")
PARTS = (".qweight", ".scales", ".zeros")


def _stored(weight: object) -> str:
    if isinstance(weight, QuantizedTensor):
        blocks = f"GGUF {weight.ggml_type} blocks"
        return f"{weight.origin}, kept as {blocks}" if weight.origin else blocks
    if isinstance(weight, Deferred) and weight.origin:
        return weight.origin
    return DTYPE_OF_TORCH.get(getattr(weight, "dtype", None), str(getattr(weight, "dtype", "?")))


def _layout(attrs: dict[str, object]) -> str:
    packing = "" if attrs.get("packing") == "none" else f" {attrs.get('packing')}"
    values = f" ({attrs['value_bits']}-bit values)" if "value_bits" in attrs else ""
    groups = f"groups of {attrs.get('group_size')}"
    return f"{attrs.get('bits')}-bit{packing}{values}, {groups}, {attrs.get('scheme')}"


def checkpoint_rows(built: BuiltProgram) -> list[tuple[str, str, str]]:
    """(name, shape, how the file stores it) of every tensor the model file holds, in its order."""
    weights = built.source.weights
    return [(name, "x".join(map(str, weight.shape)), _stored(weight)) for name, weight in weights.items()]


def artifact_rows(built: BuiltProgram) -> list[tuple[str, str, str]]:
    """(name, shape, what the artifact holds) of every weight of the optimized program."""
    layouts: dict[str, str] = {}
    for node in built.program.graph.nodes:
        if node.op not in QUANTIZED_OPS:
            continue
        for value in node.inputs:
            if value is None or value.kind is not ValueKind.PARAM or not value.name.endswith(PARTS):
                continue
            base = value.name.rsplit(".", 1)[0]
            block_type = built.gguf_types.get(base)
            layout = _layout(dict(node.attrs)) if node.op != "quantized_moe" else "experts' layouts in the op"
            layouts[value.name] = f"{block_type} blocks as {layout}" if block_type else layout
    rows = []
    for name, weight in built.program.weights.items():
        dtype = DTYPE_OF_TORCH.get(weight.dtype, str(weight.dtype))
        held = f"{dtype}, {layouts[name]}" if name in layouts else dtype
        rows.append((name, "x".join(map(str, weight.shape)), held))
    return rows


def table(rows: list[tuple[str, str, str]]) -> str:
    widths = [max((len(row[i]) for row in rows), default=0) for i in range(2)]
    return "\n".join(f"  {name:<{widths[0]}}  {shape:<{widths[1]}}  {held}" for name, shape, held in rows)
