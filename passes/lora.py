"""LoRA adapters as run-time data: `add_lora` puts a `lora` op (ir/ops/lora.py) after every linear of an
adapted module (attention q/k/v/o, MLP gate/up/down) of a decoder layer, reading the step's lora_slots and
that module's tables (ir/step.py LORA_*), which become inputs of the step; `fuse_lora_pieces` makes the
updates of a fused linear's pieces (q|k|v, gate|up) one op on the fused output, so the fusions after it
see the pattern they know (split → swiglu)."""

from __future__ import annotations

import re
from dataclasses import replace

from kiln.ir import KV_CACHE_INPUT, Node, Program, TensorType, Value, ValueKind
from kiln.ir.step import (
    LORA_A_PREFIX,
    LORA_B_PREFIX,
    LORA_RANK_DIM,
    LORA_SLOTS_DIM,
    LORA_SLOTS_INPUT,
    LORA_SLOTS_TYPE,
)
from kiln.passes.base import Pass, PassError, PassOptions
from kiln.passes.rewriter import Rewriter, producers

# the HF module names PEFT targets in the families Kiln builds (Phi-3's fused ones included)
LORA_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "qkv_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj",
)
_LINEARS = ("linear", "quantized_linear")
_MODULE_WEIGHT = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:\w+\.)*?(" + "|".join(LORA_MODULES) + r")\.weight(?:\.\w+)?$"
)


def adapted_module(weight_name: str) -> tuple[int, str] | None:
    """(layer, module) of a decoder layer's linear weight PEFT may adapt, None for any other weight."""
    match = _MODULE_WEIGHT.search(weight_name)
    return (int(match.group(1)), match.group(2)) if match else None


def lora_table_types(
    layers: int, module_in: int, module_out: int, dtype: str
) -> tuple[TensorType, TensorType]:
    """The a and b tables of one module (ir/step.py)."""
    return (
        TensorType(dtype, (layers, LORA_SLOTS_DIM, LORA_RANK_DIM, module_in)),
        TensorType(dtype, (layers, LORA_SLOTS_DIM, LORA_RANK_DIM, module_out)),
    )


def add_lora(program: Program, options: PassOptions) -> tuple[Program, bool]:
    graph = program.graph
    if not options.lora or any(v.name == LORA_SLOTS_INPUT for v in graph.inputs):
        return program, False
    if not any(v.name == KV_CACHE_INPUT for v in graph.inputs):
        return program, False  # an image encoder: its linears take no adapters
    layers = int(graph.input(KV_CACHE_INPUT).type.shape[0])
    slots = Value(LORA_SLOTS_INPUT, LORA_SLOTS_TYPE, ValueKind.INPUT)
    tables: dict[str, tuple[Value, Value]] = {}
    rewriter = Rewriter(program)
    for node in graph.nodes:
        rewriter.keep(node)
        weight = node.inputs[1] if node.op in _LINEARS and len(node.inputs) > 1 else None
        found = adapted_module(weight.name) if weight is not None else None
        if found is None:
            continue
        layer, module = found
        x, (y,) = node.inputs[0], node.outputs
        assert x is not None
        if x.type.rank != 2:
            raise PassError(f"lora: {module} of layer {layer} reads {x.type.text()}, not token rows [T, in]")
        if module not in tables:
            dtype = options.lora_dtype or x.type.dtype
            a_type, b_type = lora_table_types(layers, int(x.type.shape[1]), int(y.type.shape[1]), dtype)
            tables[module] = (
                Value(LORA_A_PREFIX + module, a_type, ValueKind.INPUT),
                Value(LORA_B_PREFIX + module, b_type, ValueKind.INPUT),
            )
        a, b = tables[module]
        (updated,) = rewriter.emit(
            "lora", [y, x, slots, a, b], {"layer": layer, "sizes": [int(y.type.shape[1])]}, node.source
        )
        rewriter.replace(y, updated)
    if not tables:
        raise PassError(
            "lora: the model has none of the linears LoRA adapters target", hint=", ".join(LORA_MODULES)
        )
    adapted = rewriter.finish()
    inputs = [*graph.inputs, slots, *(table for pair in tables.values() for table in pair)]
    return replace(adapted, graph=replace(adapted.graph, inputs=inputs)), True


def _pieces_updates(split: Node, users: dict[str, list[Node]], made_by: dict[str, Node]) -> list[Node] | None:
    """The lora ops that each update one piece of a fused linear's split, all alike but for their
    tables; None where the split is not that."""
    fused = made_by.get(split.inputs[0].name) if split.inputs[0] is not None else None
    if fused is None or fused.op not in _LINEARS:
        return None
    updates = []
    for piece in split.outputs:
        readers = users.get(piece.name, [])
        if len(readers) != 1 or readers[0].op != "lora" or readers[0].inputs[0] is not piece:
            return None
        updates.append(readers[0])
    first = updates[0]
    same = all(
        u.inputs[1] == first.inputs[1]
        and u.inputs[2] == first.inputs[2]
        and u.attrs["layer"] == first.attrs["layer"]
        for u in updates
    )
    return updates if same and first.inputs[1] == fused.inputs[0] else None


def fuse_lora_pieces(program: Program, options: PassOptions) -> tuple[Program, bool]:
    graph = program.graph
    made_by, users = producers(graph), graph.users()
    fused_updates = {
        id(node): updates
        for node in graph.nodes
        if node.op == "split" and (updates := _pieces_updates(node, users, made_by))
    }
    if not fused_updates:
        return program, False
    gone = {id(update) for updates in fused_updates.values() for update in updates}
    rewriter = Rewriter(program)
    for node in graph.nodes:
        if id(node) in gone:
            continue
        updates = fused_updates.get(id(node))
        if updates is None:
            rewriter.keep(node)
            continue
        y, x, slots = node.inputs[0], updates[0].inputs[1], updates[0].inputs[2]
        tables = [table for update in updates for table in update.inputs[3:]]
        attrs = {"layer": updates[0].attrs["layer"], "sizes": list(node.attrs["sizes"])}
        (updated,) = rewriter.emit("lora", [y, x, slots, *tables], attrs, node.source)
        pieces = rewriter.emit("split", [updated], dict(node.attrs), node.source)
        for update, piece in zip(updates, pieces, strict=True):
            rewriter.replace(update.outputs[0], piece)
    return rewriter.finish(), True


ADD_LORA = Pass(
    "add_lora", add_lora, "a LoRA update (lora op) after each adapted linear: adapters as run-time data"
)
FUSE_LORA_PIECES = Pass(
    "fuse_lora_pieces", fuse_lora_pieces, "one lora op for a fused linear's pieces (q|k|v, gate|up)"
)
