"""Tensor parallelism: split a captured program into the program of one rank of `tp`.

Megatron's layout, found by the graph's dataflow rather than by weight names:

- attention: the q, k and v projections are column-parallel (each rank computes its own heads; with
  more ranks than KV heads each rank keeps the one KV head its query heads read), the output
  projection row-parallel, followed by an `all_reduce`;
- MLP: gate and up column-parallel, down row-parallel, followed by an `all_reduce`;
- the embedding vocabulary-parallel (`shard_embedding` of the rank's rows, then `all_reduce`), the LM
  head too (the rank's vocabulary rows), its logits joined by an `all_gather` at the end;
- a row-parallel projection's bias is added by rank 0 only; norms and residuals are replicated;
- the KV cache holds the rank's KV heads only.

It runs on the captured graph, before fusion and quantization (which then run on each rank's
program). It refuses what it cannot split exactly, naming the numbers: heads or KV heads that `tp`
does not divide, a norm over all heads, mixture-of-experts layers, fused ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

from kiln.ir import KV_CACHE_INPUT, Program
from kiln.ir.builder import GraphBuilder
from kiln.ir.deferred import Deferred, Weight
from kiln.ir.gguf_blocks import QuantizedTensor
from kiln.ir.graph import Graph, Node, Value, ValueKind
from kiln.ir.types import TensorType
from kiln.passes.base import PassError

VOCAB_START = "shard.vocab_start"  # the rank's first vocabulary id: a weight, so the ranks share code
HEADWISE = ("rope", "reshape", "rms_norm", "scale")  # ops between a projection and attention
GATES = ("silu", "gelu_tanh")
SPLITTABLE = {
    "add",
    "mul",
    "silu",
    "gelu_tanh",
    "scale",
    "softcap",
    "rms_norm",
    "layer_norm",
    "reshape",
    "rope",
    "linear",
    "embedding",
    "take_rows",
    "paged_attention",
}


@dataclass(frozen=True)
class Rows:
    """A slice of a weight's rows (column-parallel) or columns (row-parallel): [start, stop)."""

    start: int
    stop: int
    columns: bool = False  # slice dim 1 (the input features) instead of dim 0


@dataclass
class _Plan:
    slices: dict[str, Rows]  # weight name → this rank's slice
    column: set[Node]  # projections whose outputs are split
    row: set[Node]  # projections whose inputs are split: an all_reduce follows
    reshapes: dict[Node, int]  # reshape → its heads on this rank
    embedding: Node | None
    lm_head: Node | None
    kv_heads: int  # this rank's KV heads


GGUFBlocks = dict[str, QuantizedTensor]  # weight name → its GGUF blocks


def shard(program: Program, tp: int, rank: int) -> Program:
    """Rank `rank`'s program of `tp`; tp 1 returns the program as it is."""
    return shard_with_blocks(program, tp, rank, {})[0]


def shard_with_blocks(program: Program, tp: int, rank: int, blocks: GGUFBlocks) -> tuple[Program, GGUFBlocks]:
    """`shard`, and the GGUF blocks of the weights (`PassOptions.gguf_blocks`) cut as the weights are:
    whole rows of blocks for a column-parallel slice, whole blocks of each row for a row-parallel one
    (refused, naming the numbers, where the rank's columns do not start and end on a block)."""
    if tp < 1 or not 0 <= rank < tp:
        raise PassError(f"rank {rank} of tensor-parallel size {tp} does not exist")
    if tp == 1:
        return program, blocks
    graph = program.graph
    plan = _plan(graph, program.weights, tp, rank)
    sharded, weights = _rebuild(graph, program.weights, plan, tp, rank)
    result = Program(sharded, weights)
    result.verify()
    cut = {name: _sliced_blocks(name, held, plan.slices.get(name), tp) for name, held in blocks.items()}
    return result, {name: held for name, held in cut.items() if name in weights}


def _sliced_blocks(name: str, blocks: QuantizedTensor, rows: Rows | None, tp: int) -> QuantizedTensor:
    if rows is None:
        return blocks
    if not rows.columns:
        return blocks.rows(rows.start, rows.stop)
    try:
        return blocks.columns(rows.start, rows.stop)
    except ValueError:
        block_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[blocks.ggml_type]][0]
        raise PassError(
            f"cannot shard {name} ({blocks.ggml_type}) at tensor-parallel size {tp}: each rank's "
            f"{rows.stop - rows.start} input features are not whole {block_size}-element "
            f"{blocks.ggml_type} blocks",
            hint="use --quantization int8 or int4 (each rank quantizes its slice), or a size that splits "
            "the blocks",
        ) from None


def _producers(graph: Graph) -> dict[str, Node]:
    return {out.name: node for node in graph.nodes for out in node.outputs}


def _projection_of(value: Value, producers: dict[str, Node], chain: list[Node]) -> Node:
    """The linear that `value` comes from through head-wise ops (collected in `chain`)."""
    node = producers.get(value.name)
    while node is not None and node.op in HEADWISE:
        chain.append(node)
        node = producers.get(node.inputs[0].name) if node.inputs[0] is not None else None
    if node is None or node.op != "linear":
        raise PassError(f"cannot shard: attention input %{value.name} does not come from a projection")
    return node


def _plan(graph: Graph, weights: dict[str, torch.Tensor], tp: int, rank: int) -> _Plan:
    unsupported = sorted({node.op for node in graph.nodes if node.op not in SPLITTABLE})
    if unsupported:
        raise PassError(
            f"cannot shard ops {', '.join(unsupported)} for tensor parallelism",
            hint="shard the captured program, before fusion and quantization; mixture-of-experts "
            "layers are not sharded yet",
        )
    producers, consumers = _producers(graph), graph.users()
    plan = _Plan({}, set(), set(), {}, None, None, 0)
    for node in graph.nodes:
        if node.op == "paged_attention":
            _plan_attention(node, producers, consumers, plan, tp, rank)
        elif node.op == "mul":
            _plan_mlp(node, producers, consumers, plan, tp, rank)
        elif node.op == "embedding":
            plan.embedding = node
    _plan_vocabulary(graph, producers, plan, tp, rank)
    return plan


def _share(size: int, what: str, tp: int) -> int:
    """size / tp, or a PassError naming `what` (a format with the size) when tp does not divide it."""
    if size % tp:
        raise PassError(
            f"tensor-parallel size {tp} does not divide {what.format(size)}",
            hint=f"choose a divisor of {size}",
        )
    return size // tp


def _weight_name(node: Node, index: int) -> str | None:
    value = node.inputs[index] if len(node.inputs) > index else None
    return value.name if value is not None and value.kind is ValueKind.PARAM else None


def _split(plan: _Plan, node: Node, start: int, stop: int, columns: bool) -> None:
    weight = _weight_name(node, 1)
    if weight is None:
        raise PassError(f"cannot shard {node.describe()}: its weight is computed, not a parameter")
    plan.slices[weight] = Rows(start, stop, columns)
    bias = _weight_name(node, 2)
    if bias is not None and not columns:
        plan.slices[bias] = Rows(start, stop)
    (plan.row if columns else plan.column).add(node)


def _plan_attention(
    node: Node, producers: dict[str, Node], consumers: dict[str, list[Node]], plan: _Plan, tp: int, rank: int
) -> None:
    q_type, k_type = node.inputs[0].type, node.inputs[1].type  # type: ignore[union-attr]
    heads, kv_heads, head_dim = int(q_type.shape[1]), int(k_type.shape[1]), int(q_type.shape[2])
    local_heads = _share(heads, "the {} attention heads", tp)
    if kv_heads % tp and tp % kv_heads:
        raise PassError(
            f"tensor-parallel size {tp} and the {kv_heads} KV heads: one must divide the other",
            hint=f"choose a divisor or a multiple of {kv_heads} that divides {heads}",
        )
    group = heads // kv_heads
    local_kv = max(kv_heads // tp, 1)
    first_kv = rank * local_heads // group
    plan.kv_heads = local_kv
    for index, (first, count) in enumerate(
        ((rank * local_heads, local_heads), (first_kv, local_kv), (first_kv, local_kv))
    ):
        chain: list[Node] = []
        projection = _projection_of(node.inputs[index], producers, chain)  # type: ignore[arg-type]
        for link in chain:
            if (
                link.op == "rms_norm"
                and link.inputs[1] is not None
                and link.inputs[1].type.shape[0] != head_dim
            ):
                raise PassError(
                    f"cannot shard {link.describe()}: it normalises over all heads at once",
                    hint="models with whole-projection q/k norms (OLMoE) are not sharded yet",
                )
            if link.op == "reshape":
                plan.reshapes[link] = count
        _split(plan, projection, first * head_dim, (first + count) * head_dim, columns=False)
    node_out = node.outputs[0]
    users = consumers.get(node_out.name, [])
    while len(users) == 1 and users[0].op == "reshape":
        plan.reshapes[users[0]] = local_heads
        users = consumers.get(users[0].outputs[0].name, [])
    if len(users) != 1 or users[0].op != "linear":
        raise PassError(f"cannot shard: attention output %{node_out.name} does not feed one projection")
    start = rank * local_heads * head_dim
    _split(plan, users[0], start, start + local_heads * head_dim, columns=True)


def _plan_mlp(
    node: Node, producers: dict[str, Node], consumers: dict[str, list[Node]], plan: _Plan, tp: int, rank: int
) -> None:
    """gate(x) * up(x) feeding one projection: gate and up column-parallel, that one row-parallel."""
    users = consumers.get(node.outputs[0].name, [])
    if len(users) != 1 or users[0].op != "linear":
        return
    projections = []
    for value in node.inputs:
        source = producers.get(value.name) if value is not None else None
        while source is not None and source.op in GATES:
            source = producers.get(source.inputs[0].name)  # type: ignore[union-attr]
        if source is None or source.op != "linear":
            return
        projections.append(source)
    local = _share(int(node.outputs[0].type.shape[-1]), "the MLP's {} intermediate features", tp)
    for projection in projections:
        _split(plan, projection, rank * local, (rank + 1) * local, columns=False)
    _split(plan, users[0], rank * local, (rank + 1) * local, columns=True)


def _plan_vocabulary(graph: Graph, producers: dict[str, Node], plan: _Plan, tp: int, rank: int) -> None:
    """The LM head: the projection the logits come from through row-wise ops."""
    node = producers.get(graph.outputs[0].name)
    while node is not None and node.op != "linear":
        node = producers.get(node.inputs[0].name) if node.inputs[0] is not None else None
    if node is None:
        raise PassError("cannot shard: the logits do not come from a projection")
    local = _share(int(node.outputs[0].type.shape[-1]), "the vocabulary of {} tokens", tp)
    _split(plan, node, rank * local, (rank + 1) * local, columns=False)
    plan.column.discard(node)
    plan.lm_head = node
    if plan.embedding is not None:
        table = _weight_name(plan.embedding, 0)
        assert table is not None
        plan.slices[table] = Rows(rank * local, (rank + 1) * local)


def _sliced(weight: Weight, rows: Rows) -> Weight:
    def cut(tensor: torch.Tensor) -> torch.Tensor:
        part = tensor[:, rows.start : rows.stop] if rows.columns else tensor[rows.start : rows.stop]
        return part.contiguous().clone()

    if not isinstance(weight, Deferred):
        return cut(weight)
    size = rows.stop - rows.start
    shape = (weight.shape[0], size, *weight.shape[2:]) if rows.columns else (size, *weight.shape[1:])
    return weight.then(shape, weight.dtype, cut)


def _rebuild(
    graph: Graph, weights: dict[str, torch.Tensor], plan: _Plan, tp: int, rank: int
) -> tuple[Graph, dict[str, torch.Tensor]]:
    builder = GraphBuilder(graph.name)
    values: dict[str, Value | None] = {}
    new_weights: dict[str, torch.Tensor] = {}
    for value in graph.inputs:
        type_ = value.type
        if value.name == KV_CACHE_INPUT:
            shape = list(type_.shape)
            shape[4] = plan.kv_heads
            type_ = TensorType(type_.dtype, tuple(shape))
        values[value.name] = builder.input(value.name, type_)
    for value in graph.params:
        rows = plan.slices.get(value.name)
        tensor = weights[value.name] if rows is None else _sliced(weights[value.name], rows)
        new_weights[value.name] = tensor
        values[value.name] = builder.param(value.name, TensorType.of(tensor))

    def mapped(value: Value | None) -> Value | None:
        return None if value is None else values[value.name]

    for node in graph.nodes:
        inputs = [mapped(v) for v in node.inputs]
        attrs = dict(node.attrs)
        op = node.op
        if node in plan.row and rank != 0 and len(inputs) > 2:
            inputs[2] = None  # the bias, added once after the all_reduce
        if node in plan.reshapes:
            attrs["shape"] = _reshaped(node, plan.reshapes[node])
        if node is plan.embedding:
            op = "shard_embedding"
            table = plan.slices[node.inputs[0].name]  # type: ignore[union-attr]
            start = torch.tensor([table.start], dtype=torch.int64)
            new_weights[VOCAB_START] = start
            inputs.append(builder.param(VOCAB_START, TensorType.of(start)))
        out = builder.op(op, inputs, attrs, source=node.source)
        if node in plan.row or node is plan.embedding:
            out = [builder.op1("all_reduce", out, attrs={"world": tp}, source=node.source)]
        for old, new in zip(node.outputs, out, strict=True):
            values[old.name] = new
    outputs = [mapped(v) for v in graph.outputs]
    logits = builder.op1("all_gather", [outputs[0]], attrs={"world": tp, "dim": -1})
    built = builder.build([logits, *outputs[1:]])  # type: ignore[list-item]
    used = {v.name for n in built.nodes for v in n.inputs if v is not None}
    built.params = [p for p in built.params if p.name in used]  # rank > 0 drops row-parallel biases
    return built, {name: w for name, w in new_weights.items() if name in used}


def _reshaped(node: Node, heads: int) -> list[int]:
    """A reshape's target with this rank's heads: [-1, H, d] → [-1, heads, d]; [-1, H * d] → [-1,
    heads * d]."""
    shape = list(node.attrs["shape"])  # type: ignore[arg-type]
    if len(shape) == 3:
        return [shape[0], heads, shape[2]]
    source = node.inputs[0].type  # type: ignore[union-attr]
    head_dim = int(source.shape[-1]) if source.rank == 3 else int(node.outputs[0].type.shape[-1])
    if source.rank == 3:
        return [shape[0], heads * head_dim]
    raise PassError(f"cannot shard {node.describe()}: not a reshape between features and heads")
