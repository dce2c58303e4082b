"""Ahead-of-time compilation: model → artifact folder, for one or more targets (see runtime/artifact.py),
and the compile cache that `serve`, `generate` and `kiln.LLM` use for a model name.

Stages: load, capture, passes (build.py, the one pipeline), then per target code generation (and its
probe), then write. The same model and options give byte-identical folders: no timestamps, no absolute
paths, sorted JSON. A folder is only ever replaced when it is empty or a Kiln artifact (or `force`), and
the new artifact is written beside it and swapped in whole.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from kiln import __version__
from kiln.backends.base import Backend, BackendError, CompileSettings, DeviceRequiredError, allocate_kv_cache
from kiln.backends.registry import get_backend
from kiln.backends.targets import (
    CUDA_ARCHS,
    FLOAT8_HINT,
    Target,
    bfloat16_refusal,
    float8_kv_cache_refusal,
    host_gpu_arch,
    host_machine,
    mismatch,
    parse_targets,
)
from kiln.build import PipelineOptions, Progress, build_program, rank_programs
from kiln.errors import KilnError
from kiln.frontend.pull import kiln_home, resolve_model
from kiln.ir import Program, print_graph
from kiln.runtime import artifact as fmt
from kiln.runtime.artifact import ArtifactError, LoadedArtifact, is_artifact, load_artifact
from kiln.runtime.step_builder import SequenceSlice, build_step_inputs

logger = logging.getLogger(__name__)

PROBE_PROMPT = "A kiln fires clay at a high temperature, turning it into"
PROBE_TOLERANCE = 1e-4  # max |logits now - logits at compile| / max |logits at compile|
AUTO = "auto"
CACHE_ENTRIES = 4  # compiled models kept in the cache (each can be hundreds of MB)


class OutputError(KilnError):
    """An output folder that compiling would have to destroy without knowing what it holds."""


def default_tuning_logs() -> Path:
    """The tuning logs shipped with kiln (the repo's tuning_logs/, package data in a wheel)."""
    return Path(__file__).resolve().parent / "tuning_logs"


DEFAULT_ACTIVATION_BITS = 16  # also what an artifact compiled before the option existed holds


@dataclass(frozen=True)
class CompileOptions:
    backend: str = "tvm"
    opt_level: int = 2
    quantization: str | None = AUTO  # auto: a GGUF keeps its own blocks, a float model stays float
    group_size: int = 32
    dtype: str = "f32"
    max_model_len: int | None = None
    max_num_seqs: int = 16
    tuning_logs: Path | None = None
    num_threads: int | None = None
    tensor_parallel_size: int = 1  # ranks: one program (code and weights) each
    kv_cache_dtype: str = "auto"  # auto: the float dtype; fp8_e4m3: float8 with calibrated scales
    activation_bits: int = DEFAULT_ACTIVATION_BITS  # CPU integer-dot kernels: 16, or 8 as llama.cpp rounds

    @property
    def pipeline(self) -> PipelineOptions:
        return PipelineOptions(
            self.opt_level,
            self.quantization,
            self.group_size,
            self.dtype,
            self.max_model_len,
            self.tensor_parallel_size,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "opt_level": self.opt_level,
            "quantization": self.quantization,
            "group_size": self.group_size,
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "tensor_parallel_size": self.tensor_parallel_size,
            "activation_bits": self.activation_bits,
        }


@dataclass(frozen=True)
class Plan:
    """What `--backend auto` / `--target` resolve to on this host, and why."""

    backend: str
    targets: list[Target]
    reason: str


def plan(backend: str = AUTO, target: str | None = None) -> Plan:
    """The backend and targets for a request. auto: TVM for the local GPU's sm_XX where this host can
    build for it, else TVM for this CPU; the reference backend only when asked for."""
    if target is not None:
        targets = parse_targets(target)
        if backend == AUTO:
            return Plan("tvm", targets, f"--target {target}")
        return Plan(backend, targets, f"--backend {backend} --target {target}")
    if backend != AUTO:
        return Plan(backend, [Target("cpu")], f"--backend {backend}")
    arch = host_gpu_arch()
    if arch is None:
        return Plan("tvm", [Target("cpu")], "no NVIDIA GPU here: TVM for this CPU")
    if arch not in CUDA_ARCHS:
        return Plan("tvm", [Target("cpu")], f"the GPU is {arch}, not one of {', '.join(CUDA_ARCHS)}: TVM CPU")
    gpu = Target("cuda", arch, host_machine())
    reason = get_backend("tvm").unsupported(gpu)
    if reason is not None:
        return Plan("tvm", [Target("cpu")], f"this host cannot build for its GPU ({reason}): TVM CPU")
    return Plan("tvm", [gpu], f"the local GPU is {arch}")


def quantization_arg(value: str | None) -> str | None:
    """A --quantization value as CompileOptions holds it ("none" is None)."""
    return None if value in (None, "none") else value


@dataclass
class CompileResult:
    path: Path
    manifest: dict[str, Any]
    stage_seconds: dict[str, float] = field(default_factory=dict)

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())


def source_digest(path: Path) -> str:
    """The sha256 of a model source's bytes (a file, or every file of a directory by relative name)."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        digest.update(file.relative_to(path if path.is_dir() else path.parent).as_posix().encode() + b"\0")
        digest.update(fmt.sha256_file(file).encode())
    return digest.hexdigest()


def check_targets(backend_name: str, targets: list[Target]) -> None:
    """Refuse at once (before any work) a backend or target this machine cannot build."""
    backend = get_backend(backend_name)
    for target in targets:
        reason = backend.unsupported(target)
        if reason is not None:
            raise BackendError(reason)


TENSOR_PARALLEL_BACKENDS = ("tvm", "reference")


def check_tensor_parallel(backend: str, targets: list[Target], world: int) -> None:
    """Refuse at once what tensor parallelism does not run on: backends without the collectives
    (ONNX Runtime's CPU build has no all-reduce, and cutting its graph at every collective would make
    two sessions a layer with a host round trip between them) and GPU targets (one NCCL rank a GPU is
    not built yet)."""
    if world < 1:
        raise BackendError(f"--tensor-parallel-size must be at least 1, got {world}")
    if world == 1:
        return
    if backend not in TENSOR_PARALLEL_BACKENDS:
        raise BackendError(
            f"tensor parallelism runs on {' and '.join(TENSOR_PARALLEL_BACKENDS)}, not {backend}: its "
            "CPU build has no collective ops to join the ranks",
            hint=f"use --backend tvm with --tensor-parallel-size {world}",
        )
    for target in targets:
        if target.kind != "cpu":
            raise BackendError(
                f"tensor parallelism runs on CPU ranks over gloo so far, not on {target.name}",
                hint="use --target cpu, or --tensor-parallel-size 1 on the GPU",
            )


def check_dtype(targets: list[Target], dtype: str | None) -> None:
    """Refuse at once bfloat16 for GPUs without bfloat16 arithmetic (before sm_80)."""
    if dtype != "bf16":
        return
    for target in targets:
        refusal = bfloat16_refusal(target)
        if refusal is not None:
            raise BackendError(refusal, hint=f"use --dtype f16 for {target.name}")


def check_activation_bits(backend: str, targets: list[Target], activation_bits: int) -> None:
    """8-bit activations are a choice of the TVM backend's CPU integer-dot kernels; refuse it elsewhere."""
    if activation_bits == DEFAULT_ACTIVATION_BITS:
        return
    if activation_bits != 8:
        raise BackendError(f"--activation-bits {activation_bits}: choose 16 or 8")
    others = [t.name for t in targets if t.kind != "cpu"]
    if backend != "tvm" or others:
        where = f"backend {backend}" if backend != "tvm" else f"target {others[0]}"
        raise BackendError(
            f"--activation-bits 8 applies to the TVM backend's CPU integer-dot kernels, not {where}",
            hint="compile with --backend tvm for cpu targets, or drop --activation-bits",
        )


FLOAT8_KV_CACHE_BACKENDS = ("tvm", "reference")


def check_kv_cache_dtype(backend: str, targets: list[Target], kv_cache_dtype: str | None, world: int) -> None:
    """Refuse at once a float8 KV cache where it cannot run: the ONNX backends have no float8 paged
    attention, GPUs before sm_89 no float8 conversions, and its calibration runs the whole model."""
    if kv_cache_dtype in ("auto", None):
        return
    if backend not in FLOAT8_KV_CACHE_BACKENDS:
        raise BackendError(
            f"a float8 KV cache runs on {' and '.join(FLOAT8_KV_CACHE_BACKENDS)}, not {backend}",
            hint="use --backend tvm, or drop --kv-cache-dtype",
        )
    if world > 1:
        raise BackendError(
            "a float8 KV cache is calibrated on the whole model, not per tensor-parallel rank",
            hint="drop --kv-cache-dtype, or use --tensor-parallel-size 1",
        )
    for target in targets:
        refusal = float8_kv_cache_refusal(target)
        if refusal is not None:
            raise BackendError(refusal, hint=FLOAT8_HINT)


# -- output folders ------------------------------------------------------------------------------------


def _protected(folder: Path) -> bool:
    """/, the home folder, the working directory and any folder holding one of them."""
    resolved = folder.resolve()
    return any(resolved == p or resolved in p.parents for p in (Path.cwd(), Path.home().resolve()))


def check_output(out: Path, force: bool = False) -> None:
    """Refuse an output that is not absent, an empty folder or a Kiln artifact (unless `force`)."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() and not out.is_symlink() and (is_artifact(out) or not any(out.iterdir())):
        return
    what = "a file" if not out.is_dir() else "a folder that is not a Kiln artifact"
    if force and not _protected(out):
        return
    if force:
        raise OutputError(
            f"{out}: refusing to replace it even with --force (it holds the current or home folder)"
        )
    raise OutputError(
        f"{out}: exists and is {what}; compiling would replace it",
        hint="choose another output, move it away, or pass --force to replace it",
    )


def _scratch_beside(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.kiln-", dir=out.parent))


def _swap_in(scratch: Path, out: Path, force: bool, keep_existing: bool = False) -> None:
    """Move the finished `scratch` folder to `out`, replacing what `check_output` allows; with
    `keep_existing`, an artifact that appeared at `out` meanwhile (another process compiling the same
    cache entry) is kept and `scratch` is left for the caller to remove."""
    if keep_existing and is_artifact(out):
        return
    check_output(out, force)
    if out.exists() or out.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.rename(old / "replaced")
        scratch.rename(out)
        shutil.rmtree(old)
    else:
        scratch.rename(out)


# -- compiling -----------------------------------------------------------------------------------------


@dataclass
class _RankCode:
    """One rank's compiled code in an artifact being written (paths relative to its root)."""

    folder: str
    files: list[str]  # relative to the target's folder
    manifest: dict[str, Any]
    kernels: dict[str, str]


def _compile_ranks(
    backend: Backend, programs: list[Program], target: Target, root: Path, settings: CompileSettings
) -> list[_RankCode]:
    """Compile each rank's program for `target` under root/<target folder>: one rank there, several each
    in its subfolder rank<r>, or sharing an earlier rank's code where its graph is the same."""
    ranks: list[_RankCode] = []
    compiled: dict[str, _RankCode] = {}  # graph text → the rank that compiled it
    for rank, program in enumerate(programs):
        text = print_graph(program.graph)
        if text not in compiled:
            subfolder = "" if len(programs) == 1 else f"rank{rank}"
            code = backend.compile(program, target, root / target.folder / subfolder, settings)
            files = [f"{subfolder}/{name}" if subfolder else name for name in code.files]
            folder = f"{target.folder}/{subfolder}" if subfolder else target.folder
            compiled[text] = _RankCode(folder, files, code.manifest, code.kernels)
        ranks.append(compiled[text])
    return ranks


def _probe(
    backend: str, target: Target, root: Path, ranks: list[dict[str, str]], token_ids: list[int]
) -> None:
    executable = fmt.load_ranks(backend, target, root, ranks)
    try:
        blocks = list(range(1, -(-len(token_ids) // 16) + 1))
        cache = allocate_kv_cache(executable, len(blocks) + 1, 16)
        logits = executable.step(build_step_inputs([SequenceSlice(token_ids, 0, blocks)], 16), cache)[0]
    finally:
        fmt.close_executable(executable)
    save_file({"logits": logits.contiguous()}, str(root / target.folder / fmt.PROBE_FILE))


def compile_stages(targets: list[Target]) -> list[str]:
    """The stage names `compile_model` reports to its progress callback, in order."""
    return ["load", "capture", "passes", *(f"codegen {t.name}" for t in targets), "write"]


def compile_model(
    model: str,
    targets: list[Target],
    options: CompileOptions,
    out: Path,
    progress: Progress | None = None,
    force: bool = False,
    keep_existing: bool = False,
) -> CompileResult:
    """Compile `model` for `targets` into the folder `out` (see the module doc for what may be replaced;
    `keep_existing`: an artifact already at `out` when this one is done wins, as a cache entry would)."""
    check_targets(options.backend, targets)
    check_tensor_parallel(options.backend, targets, options.tensor_parallel_size)
    check_output(out, force)
    backend = get_backend(options.backend)
    times: dict[str, float] = {}

    def stage(name: str, took: float) -> None:
        times[name] = took
        if progress is not None:
            progress(name, took)

    digest = source_digest(resolve_model(model))
    built = build_program(model, options.pipeline, stage)
    program, source = built.program, built.source
    programs = [program, *rank_programs(built, options.pipeline)]
    scratch = _scratch_beside(out)
    try:
        start = time.perf_counter()
        probe_ids = built.tokenizer.encode(PROBE_PROMPT)
        config_len = int(source.config.max_position_embeddings)
        max_model_len = min(options.max_model_len or config_len, config_len)
        settings = CompileSettings(
            max_num_seqs=options.max_num_seqs,
            max_model_len=max_model_len,
            tuning_logs=options.tuning_logs,
            num_threads=options.num_threads,
            activation_bits=options.activation_bits,
        )
        entries: dict[str, Any] = {}
        weights: list[str] = []  # each rank's, written after the first target compiles; targets share them
        for target in targets:
            try:
                ranks = _compile_ranks(backend, programs, target, scratch, settings)
            except DeviceRequiredError:
                # keep what the backend wrote (e.g. the ONNX for a GPU builder) at `out`, without a
                # manifest: it is not a runnable artifact
                _swap_in(scratch, out, force)
                raise
            weights = weights or [fmt.write_weights(scratch, p.weights) for p in programs]
            rank_entries = [
                {"folder": rank.folder, "weights": name} for rank, name in zip(ranks, weights, strict=True)
            ]
            runs_here = mismatch(target) is None
            if runs_here:
                _probe(options.backend, target, scratch, rank_entries, probe_ids)
            entries[target.name] = {
                "backend": backend.name,
                "backend_version": backend.version(),
                "target": target.name,
                "gpu_arch": target.gpu_arch,
                "folder": target.folder,
                "code": sorted({f for rank in ranks for f in rank.files}),
                "weights": weights[0],
                "cuda_graph_buckets": [],
                **ranks[0].manifest,
                "kernels": dict(sorted(ranks[0].kernels.items())),
                "probe": {
                    "token_ids": probe_ids,
                    "logits_file": f"{target.folder}/{fmt.PROBE_FILE}" if runs_here else None,
                    "tolerance": PROBE_TOLERANCE,
                },
            }
            if len(ranks) > 1:
                entries[target.name]["ranks"] = rank_entries
            now = time.perf_counter()
            stage(f"codegen {target.name}", now - start)
            start = now

        config = source.config
        tokenizer_fields = fmt.write_tokenizer(scratch, built.tokenizer)
        compile_fields = {**options.as_dict(), "quantization": built.quantization}
        model_id = hashlib.sha256(
            f"{digest}\n{json.dumps(compile_fields, sort_keys=True)}".encode()
        ).hexdigest()
        manifest = fmt.seal(
            scratch,
            {
                "kiln_version": __version__,
                "model": {
                    "name": source.name,
                    "architecture": config.architecture,
                    "config": config.to_dict(),
                    "source_sha256": digest,
                    "model_id": model_id,
                },
                "tokenizer": tokenizer_fields,
                "compile": {**compile_fields, "passes": [p.name for p in built.passes]},
                "limits": {"max_model_len": max_model_len, "max_num_seqs": options.max_num_seqs},
                "targets": entries,
            },
        )
        _swap_in(scratch, out, force, keep_existing)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch)
    stage("write", time.perf_counter() - start)
    return CompileResult(out, manifest, times)


# -- the compile cache ---------------------------------------------------------------------------------

_COMPILER_CODE = ("frontend", "ir", "passes", "backends", "compiler.py", "build.py")


def _tree_digest(root: Path, parts: tuple[str, ...], pattern: str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        path = root / part
        files = [path] if path.is_file() else sorted(path.rglob(pattern)) if path.is_dir() else []
        for file in files:
            if file.is_file():
                digest.update(file.relative_to(root).as_posix().encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def compiler_digest() -> str:
    """The sha256 of the code that turns a model into an artifact: a cache entry made by other code
    is never reused (the version number alone does not change between commits)."""
    return _tree_digest(Path(__file__).resolve().parent, _COMPILER_CODE, "*.py")


def cache_key(model: str, options: CompileOptions, targets: list[Target]) -> str:
    logs = options.tuning_logs
    key_parts = {
        "source": source_digest(resolve_model(model)),
        "options": options.as_dict(),
        "targets": [t.name for t in targets],
        "num_threads": options.num_threads,
        "tuning_logs": _tree_digest(logs, (".",), "*") if logs is not None else None,
        "kiln": __version__,
        "compiler": compiler_digest(),
        "backend": get_backend(options.backend).version(),
    }
    return hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:24]


def cache_folder(model: str, options: CompileOptions, targets: list[Target]) -> Path:
    return kiln_home() / "artifacts" / cache_key(model, options, targets)


ProgressFor = Callable[[Path], AbstractContextManager[Progress]]  # a display for a compile into a folder


def verdicts_folder() -> Path:
    """Where loads remember which artifact files were already hashed (see runtime/artifact.py)."""
    return kiln_home() / "verified"


def load_or_compile(
    model: str,
    options: CompileOptions,
    targets: list[Target],
    progress_for: ProgressFor | None = None,
) -> LoadedArtifact:
    """`model` compiled with `options` for `targets`, from the cache, compiling it into the cache first
    where it is not there (or is damaged)."""
    folder = cache_folder(model, options, targets)
    with _entry_lock(folder):  # processes starting the same model at once compile it once
        if is_artifact(folder):
            try:
                return load_artifact(folder, verdicts=verdicts_folder())
            except ArtifactError as error:
                logger.warning("the cached artifact %s is damaged (%s); compiling it again", folder, error)
        damaged = is_artifact(folder)  # replace it; otherwise a concurrent compile's entry is as good as ours
        with progress_for(folder) if progress_for is not None else nullcontext() as progress:
            compile_model(model, targets, options, folder, progress, keep_existing=not damaged)
        _evict_old_entries(folder.parent, keep=CACHE_ENTRIES)
        return load_artifact(folder, verdicts=verdicts_folder())


def _lock_file(entry: Path) -> Path:
    return entry.with_name(f".{entry.name}.lock")


@contextmanager
def _entry_lock(entry: Path) -> Iterator[None]:
    """An exclusive lock on one cache entry, held across processes (flock); where the cache cannot be
    written no lock is taken, and the compile reports why."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        handle = _lock_file(entry).open("a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _evict_old_entries(cache: Path, keep: int) -> None:
    """Keep the `keep` most recently compiled cache entries; only Kiln artifacts (and their lock files)
    are ever removed."""
    entries = [p for p in cache.iterdir() if is_artifact(p) and not p.is_symlink()]
    for stale in sorted(entries, key=lambda p: p.stat().st_mtime, reverse=True)[keep:]:
        shutil.rmtree(stale, ignore_errors=True)
        _lock_file(stale).unlink(missing_ok=True)
