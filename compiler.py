"""Ahead-of-time compilation: model → artifact folder, for one or more targets (see runtime/artifact.py).

Stages: load, capture, passes, then per target code generation (and its probe), then write. The
same model and options give byte-identical folders: no timestamps, no absolute paths, sorted JSON.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from kiln import __version__, build
from kiln.backends.base import BackendError, CompileSettings, DeviceRequiredError
from kiln.backends.registry import get_backend
from kiln.backends.targets import Target, mismatch
from kiln.build import runtime_tokenizer
from kiln.frontend.capture import capture_weights
from kiln.frontend.load import load_model
from kiln.frontend.pull import resolve_model
from kiln.ir import Program
from kiln.passes import PassManager, pipeline
from kiln.runtime import artifact as fmt
from kiln.runtime.step_builder import SequenceSlice, build_step_inputs

PROBE_PROMPT = "A kiln fires clay at a high temperature, turning it into"
PROBE_TOLERANCE = 1e-4  # max |logits now - logits at compile| / max |logits at compile|

Progress = Callable[[str, float], None]  # (stage, seconds it took)


@dataclass(frozen=True)
class CompileOptions:
    backend: str = "reference"
    opt_level: int = 2
    quantization: str | None = None
    group_size: int = 32
    dtype: str = "f32"
    max_model_len: int | None = None
    max_num_seqs: int = 16
    tuning_logs: Path | None = None
    num_threads: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "opt_level": self.opt_level,
            "quantization": self.quantization,
            "group_size": self.group_size,
            "dtype": self.dtype,
        }


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


def _probe(
    program: Program,
    backend_name: str,
    target: Target,
    folder: Path,
    weights_file: Path,
    token_ids: list[int],
) -> None:
    from safetensors.torch import load_file

    executable = get_backend(backend_name).load(folder, load_file(str(weights_file)), target)
    blocks = list(range(1, -(-len(token_ids) // 16) + 1))
    cache = executable.kv_cache_spec.allocate(len(blocks) + 1, 16)
    logits = executable.step(build_step_inputs([SequenceSlice(token_ids, 0, blocks)], 16), cache)[0]
    save_file({"logits": logits.contiguous()}, str(folder / fmt.PROBE_FILE))


def config_max_len(source: Any) -> int:
    return int(source.config.max_position_embeddings)


def _keep_partial(scratch: Path, out: Path) -> None:
    """A backend stopped for want of a device: keep what it wrote (e.g. the ONNX for a GPU builder) at
    `out`, without a manifest, since it is not a runnable artifact."""
    if out.exists():
        shutil.rmtree(out)
    scratch.rename(out)


def compile_model(
    model: str, targets: list[Target], options: CompileOptions, out: Path, progress: Progress | None = None
) -> CompileResult:
    check_targets(options.backend, targets)
    backend = get_backend(options.backend)
    times: dict[str, float] = {}

    def stage(name: str, start: float) -> float:
        now = time.perf_counter()
        times[name] = now - start
        if progress is not None:
            progress(name, now - start)
        return now

    start = time.perf_counter()
    path = resolve_model(model)
    source = load_model(model)
    digest = source_digest(path)
    start = stage("load", start)
    captured = capture_weights(source.config, source.float_weights())
    start = stage("capture", start)
    pass_options = build.pass_options(source, options.quantization, options.group_size, options.dtype)
    passes = pipeline(options.opt_level, pass_options)
    program, _ = PassManager(passes).run(Program(captured.graph, captured.weights), pass_options)
    start = stage("passes", start)

    scratch = out.with_name(out.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    tokenizer = runtime_tokenizer(source)
    probe_ids = tokenizer.encode(PROBE_PROMPT)
    max_model_len = min(options.max_model_len or config_max_len(source), config_max_len(source))
    settings = CompileSettings(
        max_num_seqs=options.max_num_seqs,
        max_model_len=max_model_len,
        tuning_logs=options.tuning_logs,
        num_threads=options.num_threads,
    )
    entries: dict[str, Any] = {}
    weights_name: str | None = None  # written once, after the first target compiles: targets share it
    for target in targets:
        folder = scratch / target.folder
        try:
            code = backend.compile(program, target, folder, settings)
        except DeviceRequiredError:
            _keep_partial(scratch, out)
            raise
        if weights_name is None:
            weights_name = fmt.write_weights(scratch, program.weights)
        runs_here = mismatch(target) is None
        if runs_here:
            _probe(program, options.backend, target, folder, scratch / weights_name, probe_ids)
        entries[target.name] = {
            "backend": backend.name,
            "backend_version": backend.version(),
            "target": target.name,
            "gpu_arch": target.gpu_arch,
            "folder": target.folder,
            "code": sorted(code.files),
            "weights": weights_name,
            "cuda_graph_buckets": [],
            **code.manifest,
            "kernels": dict(sorted(code.kernels.items())),
            "probe": {
                "token_ids": probe_ids,
                "logits_file": f"{target.folder}/{fmt.PROBE_FILE}" if runs_here else None,
                "tolerance": PROBE_TOLERANCE,
            },
        }
        start = stage(f"codegen {target.name}", start)

    config = source.config
    tokenizer_fields = fmt.write_tokenizer(scratch, tokenizer)
    model_id = hashlib.sha256(
        f"{digest}\n{json.dumps(options.as_dict(), sort_keys=True)}".encode()
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
            "compile": {**options.as_dict(), "passes": [p.name for p in passes]},
            "limits": {"max_model_len": max_model_len, "max_num_seqs": options.max_num_seqs},
            "targets": entries,
        },
    )
    if out.exists():
        shutil.rmtree(out)
    scratch.rename(out)
    stage("write", start)
    return CompileResult(out, manifest, times)
