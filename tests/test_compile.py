"""`kiln compile` / `verify` / `inspect` and running from an artifact, as a CI job would."""

from __future__ import annotations

import filecmp
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.runtime.artifact import SCHEMA_VERSION


def kiln(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, smollm2_gguf_path: Path) -> Path:
    out = tmp_path_factory.mktemp("compile") / "smollm2"
    result = kiln(
        "compile", str(smollm2_gguf_path), "--backend", "reference", "--quantization", "gguf", "-o", str(out)
    )
    assert result.returncode == 0, result.stderr
    progress = [line for line in result.stderr.splitlines() if line.startswith("[#")]
    stages = [line.split("] ", 1)[1].split("  ")[0] for line in progress]
    assert stages[-2:] == ["write weights", "write"]  # a progress line per stage
    assert "cpu" in result.stdout and "reference" in result.stdout  # the summary table
    return out


@pytest.mark.slow
def test_compile_verify_generate(artifact: Path) -> None:
    verified = kiln("verify", str(artifact))
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.startswith("ok:")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["schema_version"] == SCHEMA_VERSION and manifest["compile"]["quantization"] == "gguf"
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
    assert "by storage dtype: " in inspected.stdout and " U8 " in inspected.stdout


@pytest.mark.slow
def test_compiling_twice_gives_identical_files(
    artifact: Path, tmp_path: Path, smollm2_gguf_path: Path
) -> None:
    again = tmp_path / "again"
    args = ["--backend", "reference", "--quantization", "gguf", "-o", str(again), "--json"]
    result = kiln("compile", str(smollm2_gguf_path), *args)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["targets"]["cpu"]["backend"] == "reference" and summary["files"] == 5
    assert summary["peak_rss_bytes"] > summary["bytes"] / 4  # this process's high-water mark, in bytes
    files = sorted(p.relative_to(artifact) for p in artifact.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    _, mismatched, errors = filecmp.cmpfiles(artifact, again, [str(f) for f in files], shallow=False)
    assert not mismatched and not errors
    assert str(artifact.parent) not in (artifact / "manifest.json").read_text()  # no absolute paths inside


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "reference", "--target", "cuda:sm_90"], "reference backend runs on the CPU"),
        (["--target", "gpu:9000"], "unknown target 'gpu:9000'"),
        (["--backend", "tvm", "--target", "cpu:nosuchcpu"], "LLVM does not know the x86_64 CPU 'nosuchcpu'"),
        (["--target", "cpu:cortex-a999"], "LLVM does not know the aarch64 CPU 'cortex-a999'"),
        (["--target", "cpu@riscv64"], "unknown host machine 'riscv64'"),
        (["--target", "cuda:sm_75", "--dtype", "bf16"], "cuda:sm_75 has no bfloat16 arithmetic"),
        (
            ["--backend", "onnxruntime", "--tensor-parallel-size", "2"],
            "tensor parallelism runs on tvm and reference, not onnxruntime",
        ),
        (
            ["--target", "cuda:sm_90", "--tensor-parallel-size", "2"],
            "CPU ranks over gloo so far, not on cuda",
        ),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be at least 1, got 0"),
        (
            ["--backend", "onnxruntime", "--kv-cache-dtype", "fp8"],
            "(--kv-cache-dtype f16, bf16, fp8) runs on tvm and reference, not onnxruntime",
        ),
        (["--target", "cuda:sm_87", "--kv-cache-dtype", "fp8"], "(sm_89 Ada and newer); cuda:sm_87 has none"),
        (
            ["--backend", "onnxruntime", "--activation-bits", "8"],
            "applies to the TVM backend's CPU integer-dot kernels, not backend onnxruntime",
        ),
        (
            ["--target", "cpu,cuda:sm_90", "--activation-bits", "8"],
            "CPU integer-dot kernels, not target cuda:sm_90",
        ),
    ],
)
def test_impossible_requests_exit_2_at_once(tmp_path: Path, args: list[str], message: str) -> None:
    result = kiln("compile", "smollm2-135m-instruct", *args, "-o", str(tmp_path / "out"))
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_xavier_without_a_cuda_12_compiler_is_refused_naming_the_way_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_CUDA12_NVRTC", str(tmp_path / "no-nvrtc"))
    result = kiln("compile", "smollm2-135m-instruct", "--target", "cuda:sm_72", "-o", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "CUDA 13 dropped sm_70 and sm_72: run scripts/cuda12_nvrtc.sh" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_failure_exits_1_with_one_line(tmp_path: Path) -> None:
    result = kiln("compile", str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "out"))
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1 and "missing.gguf" in result.stderr


def _one_line_refusal(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kiln: error: ") and "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_an_output_that_is_not_an_artifact_is_never_replaced(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    (precious / "sub").mkdir(parents=True)
    (precious / "precious.txt").write_text("keep me")
    _one_line_refusal(kiln("compile", "smollm2-135m-instruct", "-o", str(precious)), str(precious), "--force")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me too")
    _one_line_refusal(kiln("compile", "smollm2-135m-instruct", "-o", str(a_file)), str(a_file), "is a file")
    for protected in (".", str(Path.home()), "/"):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "kiln.cli",
                "compile",
                "smollm2-135m-instruct",
                "-o",
                protected,
                "--force",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=precious,
        )
        _one_line_refusal(result, "even with --force")
    assert (precious / "precious.txt").read_text() == "keep me" and (precious / "sub").is_dir()
    assert a_file.read_text() == "keep me too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "precious"]  # no scratch left


@pytest.mark.slow
def test_an_artifact_is_replaced_and_force_replaces_anything(tmp_path: Path, artifact: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(artifact, out)
    (out / "stale.txt").write_text("from an older compile")  # still an artifact: replaced whole
    args = ["compile", "smollm2-135m-instruct", "--backend", "reference", "--quantization", "gguf", "--quiet"]
    assert kiln(*args, "-o", str(out)).returncode == 0
    assert not (out / "stale.txt").exists() and (out / "manifest.json").is_file()
    forced = tmp_path / "forced"
    forced.mkdir()
    (forced / "old.txt").write_text("the user said --force")
    result = kiln(*args, "-o", str(forced), "--force")
    assert result.returncode == 0, result.stderr
    assert not (forced / "old.txt").exists() and (forced / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forced", "out"]  # no scratch left


def test_processes_starting_one_model_at_once_compile_it_once(
    tmp_path: Path, tiny_hf_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compile cache locks an entry while it is compiled, so a second start waits and loads it."""
    import threading

    from kiln.compiler import ModelOptions, cache, resolve

    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    compiles: list[Path] = []
    real_compile = cache.compile_apart

    def counted_compile(*args, **kwargs):
        compiles.append(args[1])
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(cache, "compile_apart", counted_compile)
    plan = resolve(ModelOptions(str(tiny_hf_dir), backend="reference"))
    loaded: list[Path] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            loaded.append(cache.load_or_compile(plan).path)
        except BaseException as error:  # reported below, with the thread's traceback
            errors.append(error)

    threads = [threading.Thread(target=start) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert len(compiles) == 1 and loaded == [compiles[0], compiles[0]]
    assert sorted(p.name for p in (tmp_path / "artifacts").iterdir()) == sorted(
        [compiles[0].name, f".{compiles[0].name}.lock"]
    )
