"""Helpers for pass tests: programs from IR text with random weights, and running them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kiln.ir import DTYPES, Program, parse_graph, print_graph, structural_equal
from kiln.ir.interpreter import interpret
from kiln.passes import PassOptions


def _random(type_, generator: torch.Generator, sizes: dict[str, int]) -> torch.Tensor:
    shape = [d if isinstance(d, int) else sizes[d] for d in type_.shape]
    dtype = DTYPES[type_.dtype]
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(0, 4, shape, generator=generator, dtype=dtype)


def program_from_text(text: str, seed: int = 0) -> Program:
    graph = parse_graph(text)
    generator = torch.Generator().manual_seed(seed)
    return Program(graph, {p.name: _random(p.type, generator, {}) for p in graph.params})


def random_inputs(program: Program, sizes: dict[str, int], seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {v.name: _random(v.type, generator, sizes) for v in program.graph.inputs}


def check_rewrite(run, before: str, expected: str, sizes: dict[str, int], options: PassOptions | None = None):
    """Run one pass on `before`: its text is `expected` (also structurally), it verifies, and it computes
    the same outputs on random inputs. Returns the new program."""
    program = program_from_text(before)
    program.verify()
    after, changed = run(program, options or PassOptions())
    after.verify()
    assert print_graph(after.graph) == expected, print_graph(after.graph)
    assert structural_equal(after.graph, parse_graph(expected))
    assert changed == (before != expected)
    inputs = random_inputs(program, sizes)
    for got, want in zip(
        interpret(after.graph, after.weights, inputs),
        interpret(program.graph, program.weights, inputs),
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    return after


@pytest.fixture
def kit() -> SimpleNamespace:
    return SimpleNamespace(
        program_from_text=program_from_text, random_inputs=random_inputs, check=check_rewrite
    )
