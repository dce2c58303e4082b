"""The wheel is a complete kiln: built from this tree and installed on its own (not the editable source
tree), it compiles a tiny model with TVM and runs it, from a folder outside the source tree."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parent.parent
# The package data that code reads at run time from beside its modules.
DATA = (
    "kiln/backends/tvm/cudastub/stub.c",
    "kiln/passes/quantize/kquant_encode.c",
    "kiln/tuning_logs/README.md",
)

_CHECK_AND_RUN = """
import json, sys
from pathlib import Path
import kiln, kiln.backends.tvm.kernels, kiln.compiler
from kiln.runtime.sampling_params import SamplingParams
site = Path(sys.argv[1]).resolve()
files = {name: Path(module.__file__).resolve() for name, module in
         [("kiln", kiln), ("kernels", kiln.backends.tvm.kernels)]}
files["tuning_logs"] = kiln.compiler.default_tuning_logs()
greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
output = kiln.LLM(sys.argv[2]).generate([5, 6, 7], greedy)
print(json.dumps({"installed": {name: path.is_relative_to(site) for name, path in files.items()},
                  "tuning_logs": sorted(p.name for p in files["tuning_logs"].iterdir()),
                  "tokens": output[0].outputs[0].token_ids}))
"""


def _save_tiny_hf():
    """tests/backends/conftest.py's tiny random-weight HF model writer (its fixture `tiny_hf` does not
    reach this folder)."""
    spec = importlib.util.spec_from_file_location(
        "_test_wheel_backends_conftest", SOURCE / "tests" / "backends" / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.save_tiny_hf


def _ignore_in_copy(folder: str, names: list[str]) -> set[str]:
    """What a clean clone lacks: virtual environments, git, caches, earlier builds."""
    top = Path(folder) == SOURCE
    return {
        n
        for n in names
        if n.startswith(".")
        or n == "__pycache__"
        or n.endswith(".egg-info")
        or (top and n in ("build", "dist", "out"))
    }


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.slow
def test_installed_wheel_compiles_with_tvm_and_runs(tmp_path: Path) -> None:
    # Build from a copy, so that setuptools' build/ and egg-info stay out of the source tree and no
    # stale build/lib of an earlier build can leak into the wheel.
    source = tmp_path / "source"
    shutil.copytree(SOURCE, source, ignore=_ignore_in_copy)
    modules = {  # before the build writes build/lib/
        str(p.relative_to(source)) for p in source.rglob("*.py") if (p.parent / "__init__.py").is_file()
    }
    modules = {m for m in modules if m.split("/")[0] not in ("tests", "bench", "scripts", "docs")}
    modules.discard("setup.py")
    env = {**os.environ, "KILN_HOME": str(tmp_path / "home"), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    pip = [sys.executable, "-m", "pip"]
    _run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(source)],
        tmp_path,
        env,
    )
    (wheel,) = (tmp_path / "wheel").glob("kiln-*.whl")

    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"kiln/{m}" for m in modules} <= names  # every module of every package
    assert "kiln/backends/tvm/kernels/linear.py" in names
    logs = {f"kiln/{p.relative_to(source)}" for p in (source / "tuning_logs").rglob("*") if p.is_file()}
    assert any(name.endswith("meta.json") for name in logs)
    assert logs | set(DATA) <= names
    tops = {name.split("/")[0] for name in names}
    assert all(top == "kiln" or top.endswith(".dist-info") for top in tops)  # no tests/, bench/, ...
    assert not [n for n in names if n.startswith(("kiln/tests/", "kiln/bench/", "kiln/docs/", "kiln/setup."))]

    # Install it alone; the dependencies are the test venv's own. PYTHONPATH comes before
    # site-packages, and so before the editable install that maps `kiln` to the source tree: the
    # snippet checks that the installed copy is the one imported.
    site = tmp_path / "site"
    _run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], tmp_path, env)
    assert all((site / name).is_file() for name in DATA)
    env["PYTHONPATH"] = str(site)

    _save_tiny_hf()("llama", tmp_path / "hf")
    artifact = tmp_path / "artifact"
    kiln = [sys.executable, "-m", "kiln.cli"]
    _run(
        [
            *kiln,
            "compile",
            str(tmp_path / "hf"),
            "--backend",
            "tvm",
            "--target",
            "cpu",
            "-o",
            str(artifact),
            "--quiet",
        ],
        tmp_path,
        env,
    )
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["targets"]["cpu"]["backend"] == "tvm"

    result = _run([sys.executable, "-c", _CHECK_AND_RUN, str(site), str(artifact)], tmp_path, env)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["installed"] == {"kiln": True, "kernels": True, "tuning_logs": True}
    assert "README.md" in report["tuning_logs"]
    assert len(report["tokens"]) == 4
