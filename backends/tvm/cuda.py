"""CUDA targets: cross-compile `step` for an sm_XX GPU on a machine that may have none, and prove from
the bytes of step.so that it carries device code for that arch.

How (see cuda_build.py for why a separate process): compile cudastub/stub.c with gcc into a cache
folder as libcuda.so.1, then run `python -m kiln.backends.tvm.cuda_build` with that folder first on
LD_LIBRARY_PATH, nvcc on PATH and TVM_CUDA_COMPILE_MODE=nvcc. The child gets the IR graph as JSON (the
build needs no weight values) and writes step.so: the Relax VM bytecode, the host code, and one
fatbin holding a cubin (SASS) for the arch plus its PTX.

<target>/step.so     the compiled `step` with its device code (no weights)
<target>/step.json   parameters and layouts, KV cache spec, gpu_arch, what was compiled how, CUDA graphs,
                     the step's signature (as backend.py writes it)
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.backends.base import BackendError, CompiledCode, CompileSettings
from kiln.backends.signature_record import signature_record
from kiln.backends.targets import FLOAT8_HINT, Target, cross_compiler, float8_kv_cache_refusal
from kiln.backends.tvm.cuda_graphs import DECODE_BUCKETS
from kiln.backends.tvm.executable import STEP_ABI
from kiln.backends.tvm.layouts import stored_weights
from kiln.ir import KV_CACHE_INPUT, Program, graph_to_json

LIBRARY = "step.so"
DESCRIPTION = "step.json"
STUB_SOURCE = Path(__file__).parent / "cudastub" / "stub.c"
BUILD_TIMEOUT_S = 1800
CUDA_HOMES = ("/usr/local/cuda", "/usr/local/cuda-13.0")

FATBIN_MAGIC = 0xBA55ED50
EM_CUDA = 190
_FATBIN_KINDS = {1: "ptx", 2: "cubin"}


# --- building -------------------------------------------------------------------------------------


def find_nvcc() -> Path:
    candidates = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), *CUDA_HOMES]
    found = shutil.which("nvcc")
    if found:
        return Path(found)
    for home in candidates:
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return Path(home) / "bin" / "nvcc"
    raise BackendError(
        "tvm: CUDA targets need nvcc (the CUDA toolkit) on this machine; none was found",
        hint="install the CUDA toolkit (13.0 was used) or set CUDA_HOME",
    )


@functools.cache
def nvcc_archs(nvcc_path: Path) -> list[str]:
    """The sm_XX this nvcc compiles for (`--list-gpu-arch`: compute_XX lines)."""
    try:
        listed = subprocess.run(
            [str(nvcc_path), "--list-gpu-arch"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return ["sm_" + line.strip().removeprefix("compute_") for line in listed.split() if line.strip()]


NVRTC12_ARCHS = ("sm_70", "sm_72")  # dropped by CUDA 13; NVRTC 12 still compiles them


def nvrtc12_home() -> Path:
    """Where scripts/cuda12_nvrtc.sh put CUDA 12's NVRTC and headers ($KILN_CUDA12_NVRTC overrides)."""
    default = Path(os.environ.get("KILN_HOME", "~/.cache/kiln")).expanduser() / "cuda12-nvrtc"
    return Path(os.environ.get("KILN_CUDA12_NVRTC", default))


def device_compiler(arch: str) -> str | None:
    """What compiles device code for `arch`: nvcc (a fatbin with SASS and PTX), nvrtc12 (a bare cubin,
    for the archs CUDA 13 dropped), or None: nothing here."""
    if arch in nvcc_archs(find_nvcc()):
        return "nvcc"
    if arch in NVRTC12_ARCHS and (nvrtc12_home() / "include" / "cuda_runtime.h").is_file():
        return "nvrtc12"
    return None


def unsupported_arch(arch: str) -> str | None:
    """Why this machine cannot build device code for `arch`, None if it can."""
    if device_compiler(arch) is not None:
        return None
    nvcc_path = find_nvcc()
    reason = f"nvcc at {nvcc_path} does not compile for {arch} (it lists {', '.join(nvcc_archs(nvcc_path))})"
    if arch in NVRTC12_ARCHS:
        reason += (
            f"; CUDA 13 dropped sm_70 and sm_72: run scripts/cuda12_nvrtc.sh (CUDA 12's NVRTC from PyPI, "
            f"looked for at {nvrtc12_home()}) or put a CUDA 12 nvcc first on PATH"
        )
    return reason


def _cache_dir() -> Path:
    return Path(os.environ.get("KILN_HOME", "~/.cache/kiln")).expanduser() / "cudastub"


def build_stub() -> Path:
    """The folder holding libcuda.so.1 built from stub.c (cached by the source's hash)."""
    source = STUB_SOURCE.read_bytes()
    folder = _cache_dir() / hashlib.sha256(source).hexdigest()[:12]
    library = folder / "libcuda.so.1"
    if library.is_file():
        return folder
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise BackendError("tvm: building the libcuda stub needs a C compiler (gcc)", hint="apt install gcc")
    folder.mkdir(parents=True, exist_ok=True)
    scratch = folder / f"libcuda.so.1.{os.getpid()}.tmp"
    result = subprocess.run(
        [compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(scratch), str(STUB_SOURCE)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise BackendError(f"tvm: cannot build the libcuda stub: {result.stderr.strip()[-500:]}")
    scratch.rename(library)  # atomic: a concurrent build sees the whole file or none
    return folder


def build_environment(stub: Path, nvcc_path: Path, compiler: str = "nvcc") -> dict[str, str]:
    env = dict(os.environ)
    if compiler == "nvrtc12":  # cuda-bindings 12 and libnvrtc.so.12 first; CUDA 12 headers for NVRTC
        home = nvrtc12_home()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(home / "site"), env.get("PYTHONPATH")]))
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [str(home / "site" / "nvidia" / "cuda_nvrtc" / "lib"), env.get("LD_LIBRARY_PATH")])
        )
        env["CUDA_PATH"] = str(home)
    cuda_home = nvcc_path.resolve().parent.parent
    libraries = [str(stub)] + [str(p) for p in (cuda_home / "lib64", cuda_home / "lib") if p.is_dir()]
    if env.get("LD_LIBRARY_PATH"):
        libraries.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(libraries)
    env["PATH"] = f"{nvcc_path.parent}:{env.get('PATH', '')}"
    env["TVM_CUDA_COMPILE_MODE"] = "nvcc"
    env.setdefault("CUDA_HOME", str(cuda_home))
    return env


def run_build(
    program: Program, target: Target, folder: Path, *, ptx: bool, entry: str = "step", library: str = LIBRARY
) -> dict[str, Any]:
    """Run cuda_build in its own process; its result JSON. `entry`: "step", or "encode_image" (an image
    encoder's graph), written as `library`."""
    arch = str(target.gpu_arch)
    compiler = device_compiler(arch)
    if compiler is None:
        raise BackendError(f"tvm: {unsupported_arch(arch)}")
    env = build_environment(build_stub(), find_nvcc(), compiler)
    with tempfile.TemporaryDirectory(prefix="kiln-cuda-") as scratch:
        request = {
            "graph": str(Path(scratch) / "graph.json"),
            "arch": arch,
            "device_compiler": compiler,
            "host_triple": target.triple,
            "cross_compiler": cross_compiler(target),
            "out": str(folder),
            "ptx": ptx,
            "entry": entry,
            "library": library,
            "result": str(Path(scratch) / "result.json"),
        }
        Path(request["graph"]).write_text(json.dumps(graph_to_json(program.graph)))
        (Path(scratch) / "request.json").write_text(json.dumps(request))
        try:
            done = subprocess.run(
                [sys.executable, "-m", "kiln.backends.tvm.cuda_build", str(Path(scratch) / "request.json")],
                env=env,
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise BackendError(f"tvm: the CUDA build for {arch} took over {BUILD_TIMEOUT_S} s") from None
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-12:])
            raise BackendError(
                f"tvm: the CUDA build for {arch} failed (exit {done.returncode}):\n{tail}",
                hint="run `python -m kiln.backends.tvm.cuda_build` by hand for the whole log",
            )
        return json.loads(Path(request["result"]).read_text())


def compile_cuda(
    program: Program,
    target: Target,
    folder: Path,
    settings: CompileSettings,
    *,
    cuda_graph: bool = True,
    ptx: bool = True,
) -> CompiledCode:
    arch = target.gpu_arch
    assert arch is not None
    if program.graph.input(KV_CACHE_INPUT).type.dtype == "f8e4m3":
        refusal = float8_kv_cache_refusal(target)
        if refusal is not None:
            raise BackendError(refusal, hint=FLOAT8_HINT)
    folder.mkdir(parents=True, exist_ok=True)
    result = run_build(program, target, folder, ptx=ptx)
    code = check_cuda_library(folder / LIBRARY, target)
    graphs = {
        "enabled": cuda_graph,
        "capture": "at run time, one torch.cuda.CUDAGraph per decode bucket (not exercised on a GPU yet)",
        "buckets": list(DECODE_BUCKETS),
    }
    description = {
        "abi": STEP_ABI,
        "device": "cuda",
        "gpu_arch": arch,
        "host_triple": target.triple,
        "device_code": {
            "sass": arch,
            "ptx": f"compute_{arch[3:]}" if result["ptx"] else None,
            "nvcc": result["nvcc_flags"],
        },
        "params": result["params"],
        "embed_params": result.get("embed_params"),
        **signature_record(program.graph, result["functions"], result.get("embed_width")),
        "cuda_graph": graphs,
    }
    (folder / DESCRIPTION).write_text(json.dumps(description, indent=1, sort_keys=True) + "\n")
    return CompiledCode(
        [LIBRARY, DESCRIPTION],
        dict(result["kernels"]),
        {
            "gpu_arch": arch,
            "host_triple": target.triple,
            "device_code": code,
            "cuda_graph": {"enabled": cuda_graph},
            "cuda_graph_buckets": list(DECODE_BUCKETS) if cuda_graph else [],
        },
        stored_weights(description["params"]),
    )


# --- checking ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceCode:
    kind: str  # "cubin" | "ptx"
    arch: str  # sm_XX
    size: int


def _cubin_arch(blob: bytes, offset: int) -> str | None:
    """The sm arch of a CUDA ELF at `offset` (e_machine EM_CUDA), from e_flags."""
    if blob[offset : offset + 4] != b"\x7fELF" or offset + 52 > len(blob):
        return None
    if struct.unpack_from("<H", blob, offset + 18)[0] != EM_CUDA:
        return None
    flags = struct.unpack_from("<I", blob, offset + 48)[0]
    abi_version = blob[offset + 8]
    sm = (flags >> 8) & 0xFF if abi_version >= 8 else flags & 0xFF  # CUDA >= 12.8 moved the field
    return f"sm_{sm}"


def fatbin_entries(blob: bytes) -> list[DeviceCode]:
    """Every PTX / cubin entry of every fatbin embedded in `blob`; each cubin's arch is read from its
    ELF header and must agree with the fatbin entry's."""
    found: list[DeviceCode] = []
    magic = struct.pack("<I", FATBIN_MAGIC)
    start = blob.find(magic)
    while start >= 0:
        if start + 16 <= len(blob):
            header_size = struct.unpack_from("<H", blob, start + 6)[0]
            total = struct.unpack_from("<Q", blob, start + 8)[0]
            offset, end = start + header_size, min(start + header_size + total, len(blob))
            while offset + 32 <= end:
                kind, _, entry_header = struct.unpack_from("<HHI", blob, offset)
                payload = struct.unpack_from("<Q", blob, offset + 8)[0]
                sm = struct.unpack_from("<I", blob, offset + 28)[0]
                if kind not in _FATBIN_KINDS or entry_header < 32 or payload == 0:
                    break
                name = _FATBIN_KINDS[kind]
                if name == "cubin":
                    elf_arch = _cubin_arch(blob, offset + entry_header)
                    if elf_arch is not None and elf_arch != f"sm_{sm}":
                        raise BackendError(
                            f"a fatbin entry says sm_{sm} but its cubin's ELF header says {elf_arch}"
                        )
                found.append(DeviceCode(name, f"sm_{sm}", int(payload)))
                offset += entry_header + payload
        start = blob.find(magic, start + 4)
    return found


def loose_cubins(blob: bytes) -> list[str]:
    """Archs of CUDA ELF images anywhere in `blob` (also those outside a fatbin)."""
    archs = []
    position = blob.find(b"\x7fELF", 1)
    while position >= 0:
        arch = _cubin_arch(blob, position)
        if arch is not None:
            archs.append(arch)
        position = blob.find(b"\x7fELF", position + 1)
    return archs


def check_cuda_library(library: Path, target: Target) -> list[str]:
    """Lines proving that `library` carries device code for the target's arch; BackendError if not."""
    arch = target.gpu_arch
    blob = library.read_bytes()
    entries = fatbin_entries(blob)
    cubins = sorted({e.arch for e in entries if e.kind == "cubin"} | set(loose_cubins(blob)))
    ptx = sorted({e.arch for e in entries if e.kind == "ptx"})
    if arch not in cubins:
        source_only = b'extern "C" __global__' in blob
        raise BackendError(
            f"{library.name} carries no cubin for {arch}"
            + (f" (it has cubins for {', '.join(cubins)})" if cubins else "")
            + (" (it holds CUDA source only: built without the CUDA runtime plugin)" if source_only else ""),
            hint=f"compile it again for --target cuda:{arch}",
        )
    others = [a for a in cubins if a != arch]
    if others:
        raise BackendError(f"{library.name} for {arch} also carries cubins for {', '.join(others)}")
    sizes = sum(e.size for e in entries if e.kind == "cubin" and e.arch == arch)
    where = f"{sizes:,} bytes of SASS in a fatbin" if sizes else "a bare cubin, as NVRTC makes it"
    lines = [f"{library.name} carries a cubin for {arch} ({where})"]
    if ptx:
        lines.append(f"{library.name} carries PTX for compute_{ptx[0][3:]} (JIT for newer GPUs)")
    return lines
