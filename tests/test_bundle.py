"""`kiln bundle`: one target of an artifact plus the TVM runtime libraries and kiln's wheel; the bundle
runs with apache-tvm, ONNX and xgboost unimportable (the compiler is not needed on the device)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from kiln.backends.tvm.backend import elf_machine
from kiln.bundle import BundleError, make_bundle

# Runs `kiln generate` of an artifact with the compiler's packages made unimportable.
WITHOUT_COMPILER = """
import sys
from importlib import metadata
for name in ("tvm", "onnx", "onnxruntime", "xgboost", "transformers"):
    sys.modules[name] = None
installed_version = metadata.version
def version(name):  # the device has no apache-tvm package: its version comes from the bundle's lib/
    if name == "apache-tvm":
        raise metadata.PackageNotFoundError(name)
    return installed_version(name)
metadata.version = version
from kiln.cli import main
sys.exit(main(["generate", sys.argv[1], *sys.argv[2:]]))
"""
GENERATE_ARGS = ("--prompt", "t3 t9 t4", "--max-tokens", "6", "--temperature", "0")


def _kiln(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True, timeout=900, env=env
    )


@pytest.fixture(scope="module")
def two_target_artifact(tmp_path_factory, tiny_hf_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "artifact"
    targets = "cpu,cpu:cortex-a76" if shutil.which("aarch64-linux-gnu-gcc") else "cpu"
    result = _kiln("compile", str(tiny_hf_dir), "--target", targets, "-o", str(out))
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.slow
def test_a_cpu_bundle_runs_without_the_compiler(two_target_artifact: Path, tmp_path: Path) -> None:
    bundle = make_bundle(two_target_artifact, "cpu", tmp_path / "bundle")
    assert sorted(p.name for p in bundle.path.iterdir()) == [
        "artifact",
        "bundle.json",
        "lib",
        "requirements.txt",
        "run.sh",
        "wheels",
    ]
    manifest = json.loads((bundle.path / "artifact" / "manifest.json").read_text())
    assert list(manifest["targets"]) == ["cpu"]
    assert not (bundle.path / "artifact" / "cpu-cortex-a76").exists()
    assert all((bundle.path / "artifact" / name).is_file() for name in manifest["files"])
    (wheel,) = (bundle.path / "wheels").glob("kiln-*.whl")
    assert "kiln/bundle.py" in zipfile.ZipFile(wheel).namelist()
    requirements = (bundle.path / "requirements.txt").read_text()
    assert "apache-tvm-ffi==" in requirements and "ml_dtypes==" in requirements
    assert "no torch" in requirements
    assert (bundle.path / "lib" / "apache-tvm.version").read_text().strip() == metadata.version("apache-tvm")
    recorded = json.loads((bundle.path / "bundle.json").read_text())
    assert recorded["bytes"] == bundle.sizes and recorded["target"] == "cpu"

    env = {**os.environ, "KILN_TVM_LIBRARY_DIR": str(bundle.path / "lib")}
    bundled = subprocess.run(
        [sys.executable, "-c", WITHOUT_COMPILER, str(bundle.path / "artifact"), *GENERATE_ARGS],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert bundled.returncode == 0, bundled.stderr
    original = _kiln(
        "generate",
        str(two_target_artifact),
        "--prompt",
        "t3 t9 t4",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
    )
    assert original.returncode == 0, original.stderr
    assert bundled.stdout == original.stdout


@pytest.mark.slow
def test_an_aarch64_bundle_takes_the_aarch64_runtime(
    two_target_artifact: Path, tmp_path: Path, aarch64_python: Path
) -> None:
    sysroot_lib = aarch64_python / "site-packages" / "tvm" / "lib"
    if "cpu:cortex-a76" not in json.loads((two_target_artifact / "manifest.json").read_text())["targets"]:
        pytest.skip("no aarch64-linux-gnu-gcc: the artifact has no cpu:cortex-a76")
    if not (sysroot_lib / "libtvm_runtime.so").is_file():
        pytest.skip(f"no aarch64 libtvm_runtime.so at {sysroot_lib} (run scripts/aarch64_python.sh)")
    wheel = tmp_path / "apache_tvm-0-py3-none-manylinux_2_28_aarch64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:  # the real aarch64 library, as the wheel holds it
        archive.write(sysroot_lib / "libtvm_runtime.so", "tvm/lib/libtvm_runtime.so")
    bundle = make_bundle(two_target_artifact, "cpu:cortex-a76", tmp_path / "bundle", tvm_wheel=wheel)
    assert bundle.host_triple == "aarch64-unknown-linux-gnu"
    assert elf_machine(bundle.path / "lib" / "libtvm_runtime.so") == "aarch64"
    assert list(json.loads((bundle.path / "artifact" / "manifest.json").read_text())["targets"]) == [
        "cpu:cortex-a76"
    ]
    with pytest.raises(BundleError, match="exists"):
        make_bundle(two_target_artifact, "cpu:cortex-a76", tmp_path / "bundle", tvm_wheel=wheel)
    with pytest.raises(BundleError, match="has no target cuda:sm_90"):
        make_bundle(two_target_artifact, "cuda:sm_90", tmp_path / "other", tvm_wheel=wheel)


def test_only_tvm_targets_are_bundled(tmp_path: Path, tiny_hf_dir: Path) -> None:
    from kiln.compiler import ModelOptions, compile_model, resolve

    artifact = tmp_path / "reference"
    compile_model(resolve(ModelOptions(str(tiny_hf_dir), backend="reference")), artifact)
    with pytest.raises(BundleError, match="cpu is a reference target"):
        make_bundle(artifact, "cpu", tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()
