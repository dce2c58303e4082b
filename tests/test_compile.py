"""`kiln compile` / `verify` / `inspect` and running from an artifact, as a CI job would."""

from __future__ import annotations

import filecmp
import json
import subprocess
import sys
from pathlib import Path

import pytest


def kiln(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, smollm2_gguf_path: Path) -> Path:
    out = tmp_path_factory.mktemp("compile") / "smollm2"
    result = kiln(
        "compile", str(smollm2_gguf_path), "--quantization", "gguf", "--target", "cpu", "-o", str(out)
    )
    assert result.returncode == 0, result.stderr
    assert "[#####] write" in result.stderr  # a progress line per stage
    assert "cpu" in result.stdout and "reference" in result.stdout  # the summary table
    return out


@pytest.mark.slow
def test_compile_verify_generate(artifact: Path) -> None:
    verified = kiln("verify", str(artifact))
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.startswith("ok:")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["schema_version"] == 1 and manifest["compile"]["quantization"] == "gguf"
    assert manifest["targets"]["cpu"]["backend"] == "reference"
    assert set(manifest["files"]) >= {
        "tokenizer.json",
        "chat_template.jinja",
        "cpu/graph.json",
        "cpu/probe.safetensors",
    }
    generated = kiln(
        "generate", str(artifact), "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "8"
    )
    assert generated.returncode == 0, generated.stderr
    assert "Paris" in generated.stdout
    inspected = kiln("inspect", str(artifact), "--ir")
    assert inspected.returncode == 0 and "quantized_linear(" in inspected.stdout


@pytest.mark.slow
def test_compiling_twice_gives_identical_files(
    artifact: Path, tmp_path: Path, smollm2_gguf_path: Path
) -> None:
    again = tmp_path / "again"
    result = kiln("compile", str(smollm2_gguf_path), "--quantization", "gguf", "-o", str(again), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["targets"]["cpu"]["backend"] == "reference" and summary["files"] == 5
    files = sorted(p.relative_to(artifact) for p in artifact.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    _, mismatched, errors = filecmp.cmpfiles(artifact, again, [str(f) for f in files], shallow=False)
    assert not mismatched and not errors
    assert str(artifact.parent) not in (artifact / "manifest.json").read_text()  # no absolute paths inside


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "cuda:sm_90"], "reference backend runs on the CPU"),
        (["--target", "gpu:9000"], "unknown target 'gpu:9000'"),
        (["--backend", "tvm", "--target", "cpu:nosuchcpu"], "LLVM does not know the CPU 'nosuchcpu'"),
    ],
)
def test_impossible_requests_exit_2_at_once(tmp_path: Path, args: list[str], message: str) -> None:
    result = kiln("compile", "smollm2-135m-instruct", *args, "-o", str(tmp_path / "out"))
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_failure_exits_1_with_one_line(tmp_path: Path) -> None:
    result = kiln("compile", str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "out"))
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1 and "missing.gguf" in result.stderr
