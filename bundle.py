"""`kiln bundle`: one target of an artifact plus what a device needs to run it without the compiler.

    OUT/artifact/          the artifact with only that target (its manifest rewritten, sha256 kept)
    OUT/lib/               libtvm_runtime.so (and libtvm_runtime_cuda.so for a GPU target) of the
                           target's machine, from the apache-tvm wheel this kiln compiles with
    OUT/wheels/            kiln itself as a wheel
    OUT/requirements.txt   the runtime's Python packages, pinned as on this machine (torch apart: a GPU
                           target's only, and the device's own build)
    OUT/run.sh             `kiln serve` of the artifact with KILN_TVM_LIBRARY_DIR set to lib/
    OUT/bundle.json        target, host triple, where lib/ came from, sizes

The device needs no TVM compiler (libtvm_compiler.so, 240 MB), no ONNX, no xgboost: only the runtime
libraries and apache-tvm-ffi.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from kiln.backends.targets import Target, TargetError, host_machine
from kiln.backends.tvm.executable import TVM_VERSION_FILE, tvm_library_dir, tvm_version
from kiln.errors import KilnError
from kiln.runtime import artifact as fmt

# What `kiln serve ARTIFACT` imports; a GPU target also needs torch, whose build is the device's (NVIDIA's
# on a Jetson). A CPU target serves without torch (docs/runtime.md).
RUNTIME_PACKAGES = (
    "apache-tvm-ffi",
    "numpy",
    "ml_dtypes",
    "safetensors",
    "tokenizers",
    "jinja2",
    "gguf",
    "fastapi",
    "uvicorn",
    "uvloop",  # uvicorn runs on them when installed (the streamed token path)
    "httptools",
    "prometheus_client",
    "httpx",
)
WHEEL_PLATFORMS = {"aarch64": "manylinux_2_28_aarch64", "x86_64": "manylinux_2_28_x86_64"}


class BundleError(KilnError):
    """A bundle that cannot be made: no such target, no runtime library for its machine."""


@dataclass(frozen=True)
class Bundle:
    path: Path
    target: str
    host_triple: str
    sizes: dict[str, int]  # bytes per top-level part


def runtime_libraries(target: Target) -> list[str]:
    return ["libtvm_runtime.so", *(["libtvm_runtime_cuda.so"] if target.kind == "cuda" else [])]


def _tvm_wheel(machine: str, cache: Path) -> Path:
    """The apache-tvm wheel of this kiln's TVM version for `machine`, downloaded once into `cache`."""
    version = tvm_version()
    platform = WHEEL_PLATFORMS.get(machine)
    if platform is None:
        raise BundleError(f"no apache-tvm wheel is known for {machine}")
    found = sorted(cache.glob(f"apache_tvm-{version}-*{machine}*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    command += [
        "--platform",
        platform,
        "--python-version",
        "3.11",
        "-d",
        str(cache),
        f"apache-tvm=={version}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    found = sorted(cache.glob(f"apache_tvm-{version}-*{machine}*.whl"))
    if done.returncode != 0 or not found:
        raise BundleError(
            f"cannot download apache-tvm {version} for {machine}: {done.stderr.strip()[-400:]}",
            hint="pass the wheel with --tvm-wheel FILE (pip download --platform ... on a connected machine)",
        )
    return found[0]


def _copy_runtime(target: Target, lib: Path, wheel: Path | None, cache: Path) -> str:
    """lib/ filled with the target machine's runtime libraries; where they came from."""
    lib.mkdir(parents=True)
    (lib / TVM_VERSION_FILE).write_text(tvm_version() + "\n")
    names = runtime_libraries(target)
    if wheel is None and target.machine == host_machine():
        source = tvm_library_dir()
        for name in names:
            shutil.copy2(source / name, lib / name)
        return str(source)
    wheel = wheel or _tvm_wheel(target.machine, cache)
    with zipfile.ZipFile(wheel) as archive:
        for name in names:
            try:
                data = archive.read(f"tvm/lib/{name}")
            except KeyError:
                raise BundleError(f"{wheel} has no tvm/lib/{name}") from None
            (lib / name).write_bytes(data)
            (lib / name).chmod(0o755)
    return wheel.name


def _select_target(manifest: dict[str, Any], wanted: str) -> tuple[str, dict[str, Any]]:
    targets = manifest.get("targets") or {}
    try:
        name = Target.parse(wanted).name
    except TargetError as error:
        raise BundleError(str(error), hint=error.hint) from None
    if name not in targets:
        raise BundleError(f"the artifact has no target {wanted}", hint=f"it has {', '.join(targets)}")
    if targets[name]["backend"] != "tvm":
        raise BundleError(
            f"{name} is a {targets[name]['backend']} target; kiln bundle packs TVM targets only",
            hint="copy the whole artifact folder instead (docs/deploy.md)",
        )
    return name, targets[name]


def _copy_artifact(source: Path, out: Path, manifest: dict[str, Any], name: str) -> None:
    """The artifact with only target `name`: its folder (every rank's), its weights, the shared files."""
    entry = manifest["targets"][name]
    others = {e["folder"] for other, e in manifest["targets"].items() if other != name}
    my_weights = {rank["weights"] for rank in fmt.rank_entries(entry)}

    def kept(file: str) -> bool:
        if file.startswith("weights/"):
            return file in my_weights
        return file.split("/", 1)[0] not in others

    files = {file: digest for file, digest in manifest["files"].items() if kept(file)}
    for file in files:
        (out / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / file, out / file)
    fmt.write_json(out / fmt.MANIFEST, {**manifest, "targets": {name: entry}, "files": files})


def _kiln_wheel(wheels: Path) -> None:
    """kiln's wheel, built from a copy of its source (setuptools writes build/ and egg-info beside it)."""
    source = Path(__file__).resolve().parent
    skipped = shutil.ignore_patterns(
        ".*", "__pycache__", "*.egg-info", "build", "dist", "tests", "bench", "docs"
    )
    with tempfile.TemporaryDirectory(prefix="kiln-wheel-") as scratch:
        copy = Path(scratch) / "kiln"
        shutil.copytree(source, copy, ignore=skipped)
        command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
        done = subprocess.run(
            [*command, "-w", str(wheels), str(copy)], capture_output=True, text=True, timeout=600
        )
    if done.returncode != 0:
        raise BundleError(f"cannot build kiln's wheel from {source}: {done.stderr.strip()[-400:]}")


def _requirements(target: Target) -> str:
    lines = ["# kiln's runtime, pinned as on the compiling machine; install kiln itself with --no-deps"]
    lines += [f"{package}=={metadata.version(package)}" for package in RUNTIME_PACKAGES]
    if target.kind == "cuda":
        lines.append(
            "# torch: any build for the device with DLPack "
            f"(compiled with torch {metadata.version('torch')});"
        )
        lines.append("# on a Jetson, NVIDIA's JetPack wheel")
    else:
        lines.append("# no torch: a CPU target serves with the TVM runtime and numpy alone")
    return "\n".join(lines) + "\n"


RUN_SCRIPT = """#!/bin/sh
# Serve the bundled artifact with the bundled TVM runtime (kiln's docs/deploy.md).
here="$(cd "$(dirname "$0")" && pwd)"
KILN_TVM_LIBRARY_DIR="$here/lib" exec kiln serve "$here/artifact" "$@"
"""


def _size(path: Path) -> int:
    return (
        sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        if path.is_dir()
        else path.stat().st_size
    )


def make_bundle(
    artifact: Path, target: str, out: Path, *, tvm_wheel: Path | None = None, wheel_cache: Path | None = None
) -> Bundle:
    manifest = fmt.read_manifest(artifact)
    fmt.check_files(artifact, manifest)
    name, entry = _select_target(manifest, target)
    if out.exists():
        raise BundleError(f"{out} exists", hint="give a new folder with -o; kiln bundle never overwrites")
    parsed = Target.parse(name)
    from kiln.frontend.pull import kiln_home

    scratch = out.with_name(f".{out.name}.incoming")
    if scratch.exists():
        shutil.rmtree(scratch)
    try:
        (scratch / "artifact").mkdir(parents=True)
        _copy_artifact(artifact, scratch / "artifact", manifest, name)
        origin = _copy_runtime(parsed, scratch / "lib", tvm_wheel, wheel_cache or kiln_home() / "wheels")
        _kiln_wheel(scratch / "wheels")
        (scratch / "requirements.txt").write_text(_requirements(parsed))
        (scratch / "run.sh").write_text(RUN_SCRIPT)
        (scratch / "run.sh").chmod(0o755)
        sizes = {part.name: _size(part) for part in sorted(scratch.iterdir())}
        triple = entry.get("host_triple", parsed.triple)
        fmt.write_json(
            scratch / "bundle.json",
            {"target": name, "host_triple": triple, "runtime_libraries_from": origin, "bytes": sizes},
        )
        scratch.rename(out)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return Bundle(out, name, triple, sizes)
