"""TVM CPU executables of the shared test programs, compiled once per session."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kiln.backends.base import CompileSettings, Executable
from kiln.backends.targets import Target
from kiln.backends.tvm.backend import TVMBackend
from kiln.compiler.build import PipelineOptions, optimize
from kiln.ir import VISIBLE_ENDS_INPUT, Program
from kiln.ir.graph import Value, ValueKind
from kiln.ir.step import VISIBLE_ENDS_TYPE


def compile_tvm_cpu(
    program: Program, folder: Path, target: Target | None = None, settings: CompileSettings | None = None
) -> Executable:
    backend = TVMBackend()
    target = target or Target("cpu")
    backend.compile(program, target, folder, settings or CompileSettings())
    return backend.load(folder, program.weights, target)


@pytest.fixture(scope="session")
def tiny_llama_program(tiny_llama) -> Program:
    """The tiny Llama (tests/conftest.py) at O2."""
    config, weights = tiny_llama
    return optimize(config, weights, PipelineOptions(opt_level=2)).program


@pytest.fixture(scope="session")
def visible_ends_program(tiny_llama_program: Program) -> Program:
    """The tiny Llama at O2 with a visible_ends input (ir/step.py VISIBLE_ENDS_INPUT), read by every
    paged_attention node: a step whose images attend within themselves both ways."""
    graph = tiny_llama_program.graph
    ends = Value(VISIBLE_ENDS_INPUT, VISIBLE_ENDS_TYPE, ValueKind.INPUT)
    nodes = [replace(n, inputs=(*n.inputs, ends)) if n.op == "paged_attention" else n for n in graph.nodes]
    assert all(len(n.inputs) == 10 for n in nodes if n.op == "paged_attention")  # after `positions`
    return Program(replace(graph, inputs=[*graph.inputs, ends], nodes=nodes), tiny_llama_program.weights)


@pytest.fixture(scope="session")
def tvm_compile():
    return compile_tvm_cpu


@pytest.fixture(scope="session")
def smollm2_tvm(smollm2_o2, tmp_path_factory: pytest.TempPathFactory) -> Executable:
    """SmolLM2 float32 at O2 on TVM-CPU."""
    return compile_tvm_cpu(smollm2_o2.program, tmp_path_factory.mktemp("smollm2-tvm"))


EMULATED_RUN = Path(__file__).with_name("emulated_run.py")


@pytest.fixture
def run_aarch64(
    tmp_path: Path, aarch64_python: Path, qemu_env: Callable[[str], dict[str, str]]
) -> Callable[[list[dict[str, Any]], str], None]:
    """Runs emulated_run.py's jobs under qemu-aarch64 as the CPU `mcpu` (conftest.QEMU_CPU)."""

    def run(jobs: list[dict[str, Any]], mcpu: str) -> None:
        (tmp_path / "jobs.json").write_text(json.dumps(jobs))
        library_dir = aarch64_python / "site-packages" / "tvm" / "lib"
        command = [
            str(aarch64_python / "run"),
            str(EMULATED_RUN),
            str(library_dir),
            str(tmp_path / "jobs.json"),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=qemu_env(mcpu))
        assert done.returncode == 0, done.stderr[-3000:]

    return run
