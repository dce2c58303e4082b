"""The step signature (ir/step.py): an optional input added by a test alone, through the places
docs/design.md names for one ("The step"): its declaration (`declare_optional_input`), an op that reads
it (the op registry), each backend's lowering of that op (TVM's and ONNX's registries; the reference runs
the op's own semantics), and the code that produces it (here, the test's steps). No other file changes:
the graph's signature carries it into each backend's description, each executable binds it by name, and
`fill_absent` fills it for a step that gives none."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from tvm import relax

from kiln.backends.base import CompileSettings, Executable
from kiln.backends.onnx.ops_basic import input_name
from kiln.backends.onnx.rules import RULES, rule
from kiln.backends.onnxruntime.backend import OnnxRuntimeBackend
from kiln.backends.reference import ReferenceExecutable
from kiln.backends.targets import Target
from kiln.backends.tvm.backend import TVMBackend
from kiln.backends.tvm.lowering_registry import LOWERINGS, lowering
from kiln.compiler.build import PipelineOptions, optimize
from kiln.ir import Program
from kiln.ir.graph import Node, Value, ValueKind
from kiln.ir.ops.registry import REGISTRY, OpDef, register
from kiln.ir.step import (
    OPTIONAL_INPUTS,
    OptionalInput,
    SequenceSlice,
    StepInputs,
    StepSignature,
    build_step_inputs,
    declare_optional_input,
    fill_absent,
)
from kiln.ir.types import TensorType

OFFSETS = "token_offsets"  # the throwaway input: i64 [T], added to each token id before the embedding
OP = "offset_tokens"
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def throwaway_input() -> Iterator[None]:
    declare_optional_input(
        OptionalInput(OFFSETS, lambda _type, inputs, _device: np.zeros_like(inputs.token_ids), row_fill=0)
    )
    register(OpDef(OP, (2, 2), {}, lambda types, _attrs: [types[0]], lambda ids, offsets: ids + offsets))

    @lowering(OP)
    def _tvm(lw, node):  # type: ignore[no-untyped-def]
        return [lw.emit(relax.op.add(lw.value(node.inputs[0]), lw.value(node.inputs[1])))]

    @rule(OP)
    def _onnx(ctx, node, outputs):  # type: ignore[no-untyped-def]
        ctx.b.node("Add", [input_name(ctx, node, 0), input_name(ctx, node, 1)], outputs)
        return "onnx Add"

    yield
    OPTIONAL_INPUTS[:] = [entry for entry in OPTIONAL_INPUTS if entry.name != OFFSETS]
    for registry in (REGISTRY, LOWERINGS, RULES):
        registry.pop(OP)


@pytest.fixture(scope="module")
def programs(tiny_llama, throwaway_input) -> tuple[Program, Program]:
    """The tiny Llama at O2, and the same with token_ids + token_offsets feeding its embedding."""
    config, weights = tiny_llama
    plain = optimize(config, weights, PipelineOptions(opt_level=2)).program
    graph = plain.graph
    offsets = Value(OFFSETS, TensorType("i64", ("T",)), ValueKind.INPUT)
    token_ids = graph.input("token_ids")
    shifted = Value("shifted_ids", token_ids.type, ValueKind.NODE)
    nodes = [
        replace(n, inputs=tuple(shifted if v is token_ids else v for v in n.inputs)) for n in graph.nodes
    ]
    added = replace(
        graph, inputs=[*graph.inputs, offsets], nodes=[Node(OP, (token_ids, offsets), (shifted,)), *nodes]
    )
    return plain, Program(added, plain.weights)


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(2, 40, (n,), generator=generator).tolist() for n in (7, 5)]


def _step(prompts: list[list[int]]) -> StepInputs:
    tables = [[2 * i, 2 * i + 1] for i in range(len(prompts))]
    slices = [SequenceSlice(p, 0, t, logits_at=range(len(p))) for p, t in zip(prompts, tables, strict=True)]
    return build_step_inputs(slices, BLOCK_SIZE)


def _executables(program: Program, folder: Path) -> dict[str, Executable]:
    built = {"reference": ReferenceExecutable(program.graph, program.weights)}
    for backend in (TVMBackend(), OnnxRuntimeBackend()):
        backend.compile(program, Target("cpu"), folder / backend.name, CompileSettings())
        built[backend.name] = backend.load(folder / backend.name, program.weights, Target("cpu"))
    return built


def test_an_optional_input_added_by_a_test_alone_runs_on_every_backend(programs, tmp_path: Path) -> None:
    plain, added = programs
    assert StepSignature.of_graph(added.graph).optional == (OFFSETS,)
    base = ReferenceExecutable(plain.graph, plain.weights)
    prompts = _prompts()
    shifted = [[t + 3 for t in p] for p in prompts]
    for name, executable in _executables(added, tmp_path).items():
        assert executable.signature.takes(OFFSETS), name
        step = _step(prompts)
        # given none: filled with zeros (fill_absent), the model as without it
        none = executable.step(step, executable.kv_cache_spec.allocate(8, BLOCK_SIZE))
        expected = base.step(step, base.kv_cache_spec.allocate(8, BLOCK_SIZE))
        assert np.abs(none - expected).max() < 1e-4 * np.abs(expected).max(), name
        # given: each token id moved by 3, as the plain model on the moved ids
        moved = step.with_optional({OFFSETS: np.full_like(step.token_ids, 3)})
        logits = executable.step(moved, executable.kv_cache_spec.allocate(8, BLOCK_SIZE))
        expected = base.step(_step(shifted), base.kv_cache_spec.allocate(8, BLOCK_SIZE))
        assert np.abs(logits - expected).max() < 1e-4 * np.abs(expected).max(), name


def test_fill_absent_is_the_one_place_and_refuses_what_does_not_fit(programs) -> None:
    _, added = programs
    signature = StepSignature.of_graph(added.graph)
    step = _step(_prompts())
    filled = fill_absent(step, signature)
    assert np.array_equal(filled.optional[OFFSETS], np.zeros_like(step.token_ids))
    with pytest.raises(ValueError, match="token_offsets has 3 rows, not one for each of the 12 tokens"):
        fill_absent(step.with_optional({OFFSETS: np.zeros(3, np.int64)}), signature)
    with pytest.raises(ValueError, match="this step takes no image_rows"):
        fill_absent(step.with_optional({"image_rows": np.zeros((0, 32), np.float32)}), signature)
    assert StepSignature.from_fields(signature.to_fields()) == signature
