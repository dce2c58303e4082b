"""IR graph → one Relax function `step`, with one lowering per IR op. The lowerings come in families,
one module each (ops_basic, ops_quant, ops_attention, ops_moe, ops_vision, ops_lora), that register
into lowering_registry.py; this module imports them all and runs them over the graph with one
`Lowerer` (lowerer.py).

Signature of `step` (the executable pads the token rows and logits rows to multiples of 4, so the
register-blocked kernels need no tail predicate; `tq` and `lq` count blocks of 4):

    step(token_ids[tq, 4], positions[tq, 4], slot_mapping[tq, 4], block_tables[B, MB], seq_lens[B],
         query_start_loc[B1], logits_indices[lq, 4], kv_cache[layers, 2, NB, BS, kv_heads, head_dim],
         *weights) -> logits[lq * 4, vocab]

Then come the step signature's optional inputs in its order (ir/step.py StepSignature: the graph's
inputs; image_rows[E, hidden], visible_ends[tq, 4], lora_slots[tq, 4] and the LoRA tables, a row input
passed as row blocks as the contract's are), then row_counts[2] (the real token and logits rows) and the
weights.

On the CPU a second function, `decode`, has the same inputs and params with `tq` = `lq` = 1 (at most 4
token rows and 4 logits rows: single-stream decode); it shares the generic kernels with `step`, except
where a kernel specialized to those rows exists (`DecodeKernels`: the tuned ones, see tuning.py).

Weights are parameters (the library holds none), each in the layout its kernel reads (`ParamSpec`).
An op without a lowering, or with attributes a lowering cannot take, fails naming the op and the
model line it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tvm import relax, tirx

from kiln.backends.base import BackendError
from kiln.backends.tvm import (  # noqa: F401  (register the lowerings)
    ops_attention,
    ops_basic,
    ops_lora,
    ops_moe,
    ops_quant,
    ops_vision,
)
from kiln.backends.tvm.kernels import int_dot
from kiln.backends.tvm.lowerer import (
    ROW_BLOCK,
    ROW_COUNTS,
    TVM_DTYPES,
    DecodeKernels,
    Lowerer,
    ParamSpec,
    Schedule,
)
from kiln.backends.tvm.lowering_registry import LOWERINGS
from kiln.ir import KV_CACHE_INPUT, STEP_INPUT_TYPES, Graph, TensorType
from kiln.ir.step import EMBED
from kiln.passes.embed import embed_graph

DECODE_BLOCKS = 1  # tq and lq of `decode`
ENCODE_IMAGE = "encode_image"


def unsupported_nodes(graph: Graph) -> list[str]:
    """Why each node without a lowering cannot be lowered (the capability check)."""
    return [
        f"op {node.op} has no TVM lowering: {node.describe()}"
        for node in graph.nodes
        if node.op not in LOWERINGS
    ]


@dataclass
class LoweredStep:
    module: Any  # tvm.IRModule with the Relax functions (`step`, and `decode` if asked) and their kernels
    params: list[ParamSpec]
    kernel_origins: dict[str, str]
    functions: list[str]
    embed_params: int | None = None  # `embed` takes the first this many of `params`
    embed_width: int | None = None  # the width of `embed`'s rows (the hidden size)


def _padded(tensor_type: TensorType) -> bool:
    """Whether an input's rows are the executable's padded token (T) or logits (L) rows."""
    return tensor_type.rank >= 1 and tensor_type.shape[0] in ("T", "L")


def _lower_function(lw: Lowerer, name: str, blocks: int | None) -> None:
    """Emit one Relax function of the graph: `blocks` token (and logits) row blocks, None: symbolic."""
    lw.dims["tq"] = tirx.Var("tq", "int64") if blocks is None else blocks
    lw.dims["lq"] = tirx.Var("lq", "int64") if blocks is None else blocks
    lw.dims["T"] = lw.dims["tq"] * ROW_BLOCK
    lw.dims["L"] = lw.dims["lq"] * ROW_BLOCK
    graph = lw.graph
    inputs: list[relax.Var] = []
    for value in graph.inputs:
        if _padded(value.type):  # passed as [row blocks, 4, ...], so the blocks bind the symbol
            row_blocks = lw.dims["lq" if value.type.shape[0] == "L" else "tq"]
            rest = [lw.dim(d) for d in value.type.shape[1:]]
            dtype = TVM_DTYPES[value.type.dtype]
            var = relax.Var(value.name, relax.TensorType([row_blocks, ROW_BLOCK, *rest], dtype))
        else:
            expected = STEP_INPUT_TYPES.get(value.name, value.type)
            var = relax.Var(value.name, lw.sinfo(expected if value.name != KV_CACHE_INPUT else value.type))
        inputs.append(var)
    row_counts = relax.Var(ROW_COUNTS, relax.TensorType([2], "int64"))
    with lw.builder.function(name):
        with lw.builder.dataflow():
            for value, var in zip(graph.inputs, inputs, strict=True):
                if _padded(value.type):
                    flat = [lw.dims[str(value.type.shape[0])], *(lw.dim(d) for d in value.type.shape[1:])]
                    lw.values[value.name] = lw.emit(relax.op.reshape(var, flat))
                else:
                    lw.values[value.name] = var
            lw.values[ROW_COUNTS] = row_counts
            for node in graph.nodes:
                try:
                    results = LOWERINGS[node.op](lw, node)
                except BackendError:
                    raise
                except Exception as error:  # a TVM error while lowering: name the node
                    raise BackendError(f"tvm: cannot lower {node.describe()}: {error}") from None
                for out, result in zip(node.outputs, results, strict=True):
                    lw.values[out.name] = result
            (output,) = graph.outputs
            result = lw.builder.emit_output(lw.values[output.name])
        params = [lw.params[(spec.source, spec.transform)] for spec in lw.param_specs]
        lw.builder.emit_func_output(result, params=[*inputs, row_counts, *params])


def lower_graph(
    graph: Graph,
    target_kind: str,
    schedule: Schedule,
    decode: bool = False,
    decode_kernels: DecodeKernels | None = None,
    int_dot_isa: int_dot.Isa | None = None,
    activation_bits: int = 16,
) -> LoweredStep:
    """`step` (symbolic row blocks); with `decode`, also `decode` (one block of token and logits rows),
    which uses `decode_kernels`' kernel where it gives one and the generic kernel otherwise."""
    problems = unsupported_nodes(graph)
    if problems:
        raise BackendError(
            problems[0], hint="`--backend reference` runs every op; or add a TVM lowering for this one"
        )
    lw = Lowerer(graph, target_kind, schedule, int_dot=int_dot_isa, activation_bits=activation_bits)
    _lower_function(lw, "step", None)
    functions = ["step"]
    if decode:
        decode_lw = lw.sibling(graph, decode_kernels)
        _lower_function(decode_lw, "decode", DECODE_BLOCKS)
        if decode_lw.param_specs != lw.param_specs:
            raise BackendError("tvm: `decode` and `step` lowered to different weight parameters")
        functions.append("decode")
    embedded = _lower_embed(lw, graph)
    if embedded is not None:
        functions.append(EMBED)
    embed_params, embed_width = embedded or (None, None)
    return LoweredStep(
        lw.builder.get(), lw.param_specs, lw.kernel_origins, functions, embed_params, embed_width
    )


def _lower_embed(lw: Lowerer, graph: Graph) -> tuple[int, int] | None:
    """`embed` (passes/embed.py: the step up to the LM head; symbolic row blocks, `step`'s kernels): how
    many of `step`'s weight parameters it takes (the first ones) and its rows' width; None for a graph
    with no LM head."""
    hidden_graph = embed_graph(graph)
    if hidden_graph is None:
        return None
    embed_lw = lw.sibling(hidden_graph)
    _lower_function(embed_lw, EMBED, None)
    taken = len(embed_lw.param_specs)
    if embed_lw.param_specs != lw.param_specs[:taken]:
        raise BackendError("tvm: `embed` does not take the first of `step`'s weight parameters")
    return taken, int(hidden_graph.outputs[0].type.shape[-1])


def lower_encoder(graph: Graph, target_kind: str, schedule: Schedule) -> LoweredStep:
    """An image encoder's graph (inputs typed over padded rows T) as one Relax function `encode_image`,
    called as `encode_image(*inputs, row_counts, *weights)` with T a multiple of 4."""
    problems = unsupported_nodes(graph)
    if problems:
        raise BackendError(problems[0])
    lw = Lowerer(graph, target_kind, schedule)
    _lower_function(lw, ENCODE_IMAGE, None)
    return LoweredStep(lw.builder.get(), lw.param_specs, lw.kernel_origins, [ENCODE_IMAGE])
