"""aarch64 artifacts built on this x86-64 machine: a `cpu:cortex-a76` build of the tiny Llama runs one
step under qemu-aarch64 (Debian's arm64 Python with numpy, tvm_ffi and libtvm_runtime.so only, made by
scripts/aarch64_python.sh) and matches the reference interpreter; loading it here is refused naming both
triples; `cuda:sm_87`'s step.so is an aarch64 ELF carrying sm_87 SASS."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kiln as kiln_package
from kiln.backends.base import BackendError, CompileSettings, KVCacheSpec
from kiln.backends.reference import ReferenceExecutable
from kiln.backends.targets import Target, host_machine
from kiln.backends.tvm.backend import TVMBackend, elf_machine
from kiln.backends.tvm.executable import step_tensors
from kiln.backends.tvm.layouts import apply_layout
from kiln.compiler.build import PipelineOptions, optimize
from kiln.ir.step import SequenceSlice, StepSignature, build_step_inputs

BLOCK_SIZE = 16
A76 = Target.parse("cpu:cortex-a76")
# max |emulated aarch64 - reference| / max |reference|: float32 as on x86; quantized linears take
# int8 activations through sdot (kernels/int_dot.py), as the x86 int-dot kernels do.
TOLERANCE = {None: 1e-4, "int4": 1e-3}


def _program(tiny_llama, quantization: str | None):
    config, weights = tiny_llama
    return optimize(config, weights, PipelineOptions(opt_level=2, quantization=quantization)).program


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "int4"])  # every plane: kernels/test_int_dot.py
def test_cortex_a76_step_under_qemu_matches_the_reference(
    quantization: str | None, tiny_llama, tmp_path: Path, run_aarch64
) -> None:
    program = _program(tiny_llama, quantization)
    code = TVMBackend().compile(program, A76, tmp_path / "a76", CompileSettings())
    description = json.loads((tmp_path / "a76" / "step.json").read_text())
    assert description["host_triple"] == "aarch64-unknown-linux-gnu"
    assert {"asimd", "asimddp"} <= set(description["cpu_features"])
    assert elf_machine(tmp_path / "a76" / "step.so") == "aarch64"
    if quantization is not None:
        assert any(name.startswith("qdot_neon_dot") for name in code.kernels), code.kernels

    prompt = torch.randint(3, 90, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    inputs = build_step_inputs([SequenceSlice(prompt, 0, [1, 0])], BLOCK_SIZE)
    spec = KVCacheSpec.of_graph(program.graph)
    reference = ReferenceExecutable(program.graph, program.weights)
    expected = reference.step(inputs, spec.allocate(2, BLOCK_SIZE))
    *tensors, row_counts = step_tensors(inputs, StepSignature.of_graph(program.graph))
    weights = [apply_layout(p["transform"], program.weights[p["source"]]) for p in description["params"]]
    args = [*tensors, spec.allocate(2, BLOCK_SIZE), row_counts, *weights]
    np.savez(tmp_path / "inputs.npz", **{f"arg_{i}": np.asarray(a) for i, a in enumerate(args)})
    run_aarch64(
        [
            {
                "library": str(tmp_path / "a76" / "step.so"),
                "function": "step",
                "vm": True,
                "inputs": str(tmp_path / "inputs.npz"),
                "output": str(tmp_path / "logits.npy"),
            }
        ],
        "cortex-a76",
    )
    ours = np.load(tmp_path / "logits.npy")[: expected.shape[0]]
    error = float(np.abs(ours - expected).max() / np.abs(expected).max())
    assert error < TOLERANCE[quantization], error


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None, reason="no aarch64-linux-gnu-gcc")
def test_an_aarch64_build_is_refused_here_naming_both_triples(tiny_llama, tmp_path: Path) -> None:
    if host_machine() != "x86_64":
        pytest.skip("the refusal is of an aarch64 build on an x86-64 machine")
    program = _program(tiny_llama, None)
    backend = TVMBackend()
    backend.compile(program, A76, tmp_path / "a76", CompileSettings())
    with pytest.raises(BackendError) as refused:
        backend.load(tmp_path / "a76", program.weights, A76)
    message = str(refused.value)
    assert "aarch64-unknown-linux-gnu" in message and "x86_64-unknown-linux-gnu" in message
    assert "for aarch64" in "\n".join(backend.check_structure(tmp_path / "a76", A76))


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None, reason="no aarch64-linux-gnu-gcc")
def test_orin_build_is_aarch64_host_code_with_sm_87_sass(tiny_llama, tmp_path: Path) -> None:
    from kiln.backends.tvm.cuda import find_nvcc

    try:
        find_nvcc()
    except BackendError as error:
        pytest.skip(str(error))
    orin = Target.parse("cuda:sm_87")
    program = _program(tiny_llama, "int4")
    code = TVMBackend().compile(program, orin, tmp_path / "orin", CompileSettings())
    library = tmp_path / "orin" / "step.so"
    assert elf_machine(library) == "aarch64"
    assert json.loads((tmp_path / "orin" / "step.json").read_text())["host_triple"] == orin.triple
    lines = TVMBackend().check_structure(tmp_path / "orin", orin)
    assert any("carries a cubin for sm_87" in line for line in lines), lines
    assert code.manifest["host_triple"] == "aarch64-unknown-linux-gnu"
    needed = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True).stdout
    assert "NEEDED" not in needed or "libc.so.6" in needed  # nothing JetPack lacks


GENERATE = ("--prompt", "The capital of France is", "--max-tokens", "8", "--temperature", "0")


@pytest.mark.slow
def test_smollm2_greedy_tokens_under_qemu_match_x86_with_the_whole_runtime(
    tmp_path: Path, aarch64_python: Path, qemu_env
) -> None:
    """kiln generate itself (tokenizer, engine, the TVM runtime; no torch, no TVM compiler) in the emulated
    aarch64 Python with scripts/aarch64_runtime.sh's packages, against the same artifact's x86 target."""
    runtime_packages = aarch64_python / "runtime-packages"
    if not (runtime_packages / ".spec").is_file():
        pytest.skip(f"no aarch64 runtime packages at {runtime_packages} (run scripts/aarch64_runtime.sh)")
    artifact = tmp_path / "smollm2"
    kiln = [sys.executable, "-m", "kiln.cli"]
    targets = ["--target", "cpu,cpu:cortex-a76"]
    compiled = subprocess.run(
        [*kiln, "compile", "smollm2-135m-instruct", *targets, "-o", str(artifact)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert compiled.returncode == 0, compiled.stderr
    generate = ["generate", str(artifact), *GENERATE, "--target"]
    x86 = subprocess.run([*kiln, *generate, "cpu"], capture_output=True, text=True, timeout=300)
    assert x86.returncode == 0, x86.stderr
    (tmp_path / "path").mkdir()
    (tmp_path / "path" / "kiln").symlink_to(Path(kiln_package.__file__).parent)
    env = {
        **qemu_env("cortex-a76"),
        "KILN_HOME": str(tmp_path / "home"),
        "KILN_TVM_LIBRARY_DIR": str(aarch64_python / "site-packages" / "tvm" / "lib"),
        "PYTHONPATH": f"{runtime_packages}:{tmp_path / 'path'}",
    }
    emulated = subprocess.run(
        [str(aarch64_python / "run"), "-m", "kiln.cli", *generate, "cpu:cortex-a76"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert emulated.returncode == 0, emulated.stderr[-3000:]
    assert emulated.stdout == x86.stdout and x86.stdout.strip()
