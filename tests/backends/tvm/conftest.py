"""TVM CPU executables of the shared test programs, compiled once per session."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kiln.backends.base import CompileSettings, Executable
from kiln.backends.targets import Target
from kiln.backends.tvm.backend import TVMBackend
from kiln.build import PipelineOptions, optimize
from kiln.ir import Program


def compile_tvm_cpu(program: Program, folder: Path, target: Target | None = None) -> Executable:
    backend = TVMBackend()
    target = target or Target("cpu")
    backend.compile(program, target, folder, CompileSettings())
    return backend.load(folder, program.weights, target)


@pytest.fixture(scope="session")
def tiny_llama_program(tiny_llama) -> Program:
    """The tiny Llama (tests/conftest.py) at O2."""
    config, weights = tiny_llama
    return optimize(config, weights, PipelineOptions(opt_level=2)).program


@pytest.fixture(scope="session")
def tvm_compile():
    return compile_tvm_cpu


@pytest.fixture(scope="session")
def smollm2_tvm(smollm2_o2, tmp_path_factory: pytest.TempPathFactory) -> Executable:
    """SmolLM2 float32 at O2 on TVM-CPU."""
    return compile_tvm_cpu(smollm2_o2.program, tmp_path_factory.mktemp("smollm2-tvm"))


@pytest.fixture(scope="session")
def smollm2_q4_1(smollm2_gguf_path: Path):
    """SmolLM2 with its GGUF Q4_1 (and Q8_0 LM head) blocks imported, O2, on the reference backend."""
    from kiln.build import PipelineOptions, build_reference

    return build_reference(str(smollm2_gguf_path), PipelineOptions(opt_level=2, quantization="gguf"))


AARCH64_PYTHON = Path(
    os.environ.get("KILN_AARCH64_PYTHON", Path.home() / ".cache" / "kiln" / "aarch64-python")
)
EMULATED_RUN = Path(__file__).with_name("emulated_run.py")


def missing_for_aarch64_emulation() -> str | None:
    if shutil.which("aarch64-linux-gnu-gcc") is None:
        return "no aarch64-linux-gnu-gcc (apt-get install gcc-aarch64-linux-gnu)"
    if shutil.which("qemu-aarch64") is None:
        return "no qemu-aarch64 (apt-get install qemu-user)"
    if not (AARCH64_PYTHON / "run").is_file():
        return f"no aarch64 Python at {AARCH64_PYTHON} (run scripts/aarch64_python.sh)"
    return None


@pytest.fixture
def aarch64_python() -> Path:
    """The emulated aarch64 Python's folder (its `run` starts it); skips, naming what is missing."""
    missing = missing_for_aarch64_emulation()
    if missing is not None:
        pytest.skip(missing)
    return AARCH64_PYTHON


@pytest.fixture
def run_aarch64(tmp_path: Path, aarch64_python: Path) -> Callable[[list[dict[str, Any]]], None]:
    """Runs emulated_run.py's jobs under qemu-aarch64."""

    def run(jobs: list[dict[str, Any]]) -> None:
        (tmp_path / "jobs.json").write_text(json.dumps(jobs))
        library_dir = AARCH64_PYTHON / "site-packages" / "tvm" / "lib"
        command = [
            str(AARCH64_PYTHON / "run"),
            str(EMULATED_RUN),
            str(library_dir),
            str(tmp_path / "jobs.json"),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]

    return run
