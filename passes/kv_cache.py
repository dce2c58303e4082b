"""The KV cache's storage dtype when it is not the activations': float16 or bfloat16 (a cast on write,
back to float32 on read), or float8 e4m3, where each attention layer also gets per-tensor scales for its
keys and values, calibrated by running the program once.

Calibration: the reference interpreter runs one prefill of CALIBRATION_SEQUENCES seeded random token
sequences with the program's own cache dtype; each layer's largest |K| and |V| in the cache, times
HEADROOM, becomes 448 (float8's largest value), so the scale is amax * HEADROOM / 448. The headroom
keeps values up to HEADROOM times the calibration's largest representable, for the price of
precision at the very small end only (float8 keeps 3 mantissa bits at every exponent down to 2^-6).
Values past the range saturate at +-448 (ir/ops/attention.py `to_cache`).
"""

from __future__ import annotations

import torch

from kiln.ir import DTYPES, KV_CACHE_INPUT, Graph, Program, TensorType, Value, verify
from kiln.ir.builder import GraphBuilder
from kiln.ir.interpreter import check_weights, interpret
from kiln.ir.ops.attention import FP8_MAX
from kiln.ir.step import SequenceSlice, build_step_inputs
from kiln.passes.base import KV_CACHE_STORAGE, Pass, PassError, PassOptions

HEADROOM = 4.0
CALIBRATION_SEQUENCES = 2
CALIBRATION_TOKENS = 48  # a sequence
CALIBRATION_SEED = 0
BLOCK_SIZE = 16


def _zero_cache(graph: Graph, num_blocks: int) -> torch.Tensor:
    cache = graph.input(KV_CACHE_INPUT).type
    layers, two, _, _, kv_heads, head_dim = cache.shape
    return torch.zeros((layers, two, num_blocks, BLOCK_SIZE, kv_heads, head_dim), dtype=DTYPES[cache.dtype])


def calibrated_scales(program: Program) -> dict[int, tuple[float, float]]:
    """layer → (key scale, value scale) from one seeded prefill through the reference interpreter."""
    graph = program.graph
    if any(node.op.startswith("all_") for node in graph.nodes):
        raise PassError(
            "an fp8 KV cache is calibrated on the whole model, and this program is one tensor-parallel shard",
            hint="drop --kv-cache-dtype fp8_e4m3, or compile with --tensor-parallel-size 1",
        )
    if any(weight.is_meta for weight in program.weights.values()):
        raise PassError(
            "an fp8 KV cache is calibrated by running the model, and this program's weights are shapes only"
        )
    tables = {"embedding": 0, "quantized_embedding": 1}  # the op → its table's input
    vocab = next(
        int(table.type.shape[0])
        for node in graph.nodes
        if node.op in tables and (table := node.inputs[tables[node.op]]) is not None
    )
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    blocks = -(-CALIBRATION_TOKENS // BLOCK_SIZE)
    slices = [
        SequenceSlice(
            torch.randint(0, vocab, (CALIBRATION_TOKENS,), generator=generator).tolist(),
            0,
            list(range(1 + s * blocks, 1 + (s + 1) * blocks)),
        )
        for s in range(CALIBRATION_SEQUENCES)
    ]
    verify(graph)
    check_weights(graph, program.weights)
    cache = _zero_cache(graph, 1 + CALIBRATION_SEQUENCES * blocks)
    inputs = {**build_step_inputs(slices, BLOCK_SIZE).as_dict(), KV_CACHE_INPUT: cache}
    interpret(graph, program.weights, inputs)
    scales = {}
    for layer in range(cache.shape[0]):
        key_max = max(float(cache[layer, 0].abs().max()), 1e-6)
        value_max = max(float(cache[layer, 1].abs().max()), 1e-6)
        scales[layer] = (key_max * HEADROOM / FP8_MAX, value_max * HEADROOM / FP8_MAX)
    return scales


def kv_cache_dtype(program: Program, options: PassOptions) -> tuple[Program, bool]:
    graph = program.graph
    cache_dtype = KV_CACHE_STORAGE.get(options.kv_cache_dtype or "")
    if cache_dtype is None or graph.input(KV_CACHE_INPUT).type.dtype == cache_dtype:
        return program, False
    scales = calibrated_scales(program) if cache_dtype == "f8e4m3" else {}
    builder = GraphBuilder(graph.name)
    mapping: dict[str, Value] = {}
    for value in graph.inputs:
        type_ = TensorType(cache_dtype, value.type.shape) if value.name == KV_CACHE_INPUT else value.type
        mapping[value.name] = builder.input(value.name, type_)
    for param in graph.params:
        mapping[param.name] = builder.param(param.name, param.type)
    for node in graph.nodes:
        inputs = [mapping[v.name] if v is not None else None for v in node.inputs]
        attrs = dict(node.attrs)
        if node.op == "paged_attention" and scales:
            attrs["kv_scale"] = list(scales[int(attrs["layer"])])
        outputs = builder.op(node.op, inputs, attrs=attrs, source=node.source)
        mapping.update({old.name: new for old, new in zip(node.outputs, outputs, strict=True)})
    new_graph: Graph = builder.build([mapping[v.name] for v in graph.outputs])
    return Program(new_graph, program.weights), True


KV_CACHE_DTYPE = Pass(
    "kv_cache_dtype",
    kv_cache_dtype,
    "the KV cache stored as float16, bfloat16, or float8 e4m3 with calibrated per-layer scales",
)
