"""The compile: a plan → an artifact folder, for one or more targets (see runtime/artifact.py).

Stages: load, capture, passes (compiler/build.py, the one pipeline), then per target code generation (and its
probe), then write. The same model and options give byte-identical folders: no timestamps, no absolute
paths, sorted JSON. The folder is written beside `out` and swapped in whole (compiler/output.py).
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

import torch
from safetensors.torch import save_file

from kiln.backends.base import (
    Backend,
    BackendError,
    CompileSettings,
    DeviceRequiredError,
    StoredWeight,
    allocate_kv_cache,
)
from kiln.backends.registry import get_backend
from kiln.backends.targets import Target, mismatch
from kiln.compiler.build import BuiltProgram, Progress, build_program, rank_programs
from kiln.compiler.output import check_output, scratch_beside, swap_in
from kiln.compiler.plan import Plan
from kiln.compiler.source_digest import model_digest
from kiln.errors import ModelLoadError
from kiln.frontend.pull import resolve_model
from kiln.ir import DTYPES, Program, print_graph
from kiln.ir.deferred import materialize
from kiln.ir.step import SequenceSlice, build_step_inputs
from kiln.ir.vision import VisionSpec
from kiln.runtime import artifact as fmt
from kiln.runtime.image_processing import ImageProcessingError, processing_of
from kiln.runtime.scheduler import DEFAULT_MAX_NUM_SEQS
from kiln.runtime.weights_file import Entry
from kiln.version import __version__

PROBE_PROMPT = "A kiln fires clay at a high temperature, turning it into"
PROBE_TOLERANCE = 1e-4  # max |logits now - logits at compile| / max |logits at compile|


@dataclass(frozen=True)
class CompileLimits:
    """The longest sequence and the most sequences the artifact is built for (None: the model's own
    maximum length)."""

    max_model_len: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS


@dataclass
class CompileResult:
    path: Path
    manifest: dict[str, Any]
    stage_seconds: dict[str, float] = field(default_factory=dict)

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())


@dataclass
class _RankCode:
    """One rank's compiled code in an artifact being written (paths relative to its root)."""

    folder: str
    files: list[str]  # relative to the target's folder
    manifest: dict[str, Any]
    kernels: dict[str, str]
    weights: list[StoredWeight] | None  # as the code reads them (None: the program's, as they are)


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
            compiled[text] = _RankCode(folder, files, code.manifest, code.kernels, code.weights)
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
        executable.close()
    save_file({"logits": torch.from_numpy(logits.copy())}, str(root / target.folder / fmt.PROBE_FILE))


def _write_weights(root: Path, program: Program, codes: list[_RankCode]) -> tuple[str, str]:
    """One rank's weights file, holding what each target's code reads, each tensor once (`stored_weights`),
    made and written one at a time. (path, sha256)."""
    ordered = stored_weights(program, [code.weights for code in codes])
    made = weight_maker(program)
    return fmt.write_weights(root, [Entry(w.name, w.dtype, w.shape, lambda w=w: made(w)) for w in ordered])


def stored_weights(program: Program, wanted: list[list[StoredWeight] | None]) -> list[StoredWeight]:
    """What an artifact stores for compiled code that reads `wanted` (one list per target's code; None:
    the program's weights as they are), each weight once, in the program's order."""
    stored: dict[str, StoredWeight] = {}
    for weights in wanted:
        if weights is None:
            weights = [
                StoredWeight(p.name, p.name, tuple(p.type.shape), _dtype(p.type.dtype), _as_is)
                for p in program.graph.params
            ]  # type: ignore[arg-type]
        for weight in weights:
            stored.setdefault(weight.name, weight)
    order = {param.name: index for index, param in enumerate(program.graph.params)}
    return sorted(stored.values(), key=lambda w: (order.get(w.source, len(order)), w.name))


def weight_maker(program: Program) -> Callable[[StoredWeight], torch.Tensor]:
    """Makes a stored weight from the program's: laid out for its kernels where the code says how. Ask
    in `stored_weights`' order: a source's layouts one after another, so it is computed once."""
    last: dict[str, torch.Tensor] = {}

    def made(weight: StoredWeight) -> torch.Tensor:
        if weight.source not in last:
            last.clear()
            last[weight.source] = materialize(program.weights[weight.source])
        return weight.lay_out(last[weight.source])

    return made


def _compile_encoders(
    backend: Backend,
    encoder: Program | None,
    vision: VisionSpec | None,
    targets: tuple[Target, ...],
    root: Path,
    settings: CompileSettings,
    world: int,
) -> dict[str, Any]:
    """A vision-language model's image encoder (the artifact's second entry point, `encode_image`)
    compiled for each target under <target folder>/encoder, its weights written once: {target name:
    its manifest entry, "weights": (path, sha256)}; empty for a text-only model."""
    if encoder is None or vision is None:
        return {}
    if world > 1:
        raise BackendError(
            "a vision-language model compiles for one rank only so far",
            hint="leave out --tensor-parallel-size",
        )
    try:
        processing_of(vision.preprocessor)  # the runtime will read it: refuse now what it could not
    except ImageProcessingError as error:
        raise ModelLoadError(
            f"the model's image processor config: {error}", hint="fix preprocessor_config.json"
        ) from None
    entries: dict[str, Any] = {}
    codes = []
    for target in targets:
        folder = f"{target.folder}/encoder"
        code = backend.compile_encoder(encoder, target, root / folder, settings)
        codes.append(_RankCode(folder, code.files, code.manifest, code.kernels, code.weights))
        entries[target.name] = {"folder": folder, "code": [f"{folder}/{name}" for name in code.files]}
    weights = _write_weights(root, encoder, codes)
    for entry in entries.values():
        entry["weights"] = weights[0]
    return {**entries, "weights": weights}


def _gguf_types(built: BuiltProgram) -> dict[str, Any]:
    """A GGUF-blocks artifact's block type of each quantized weight (by HF name), so that new float
    weights can be quantized as the file was (kiln/compiler/refit.py)."""
    return {"gguf_types": built.gguf_types} if built.gguf_types else {}


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def compile_model(
    plan: Plan,
    out: Path,
    limits: CompileLimits | None = None,
    progress: Progress | None = None,
    force: bool = False,
    keep_existing: bool = False,
) -> CompileResult:
    """Compile `plan` into the folder `out` (see compiler/output.py for what may be replaced;
    `keep_existing`: an artifact already at `out` when this one is done wins, as a cache entry would)."""
    limits = limits or CompileLimits()
    check_output(out, force)
    backend = get_backend(plan.backend)
    times: dict[str, float] = {}

    def stage(name: str, took: float) -> None:
        times[name] = took
        if progress is not None:
            progress(name, took)

    digest = model_digest(resolve_model(plan.model), plan.mmproj)
    pipeline = plan.pipeline(limits.max_model_len)
    built = build_program(plan.model, pipeline, stage, plan.mmproj)
    program, source = built.program, built.source
    programs = [program, *rank_programs(built, pipeline)]
    scratch = scratch_beside(out)
    try:
        start = time.perf_counter()
        probe_ids = built.tokenizer.encode(PROBE_PROMPT)
        config_len = int(source.config.max_position_embeddings)
        max_model_len = min(limits.max_model_len or config_len, config_len)
        settings = CompileSettings(
            max_num_seqs=limits.max_num_seqs,
            max_model_len=max_model_len,
            tuning_logs=plan.tuning_logs,
            num_threads=plan.options.num_threads,
            activation_bits=plan.activation_bits,
        )
        compiled: dict[str, list[_RankCode]] = {}
        for target in plan.targets:
            try:
                compiled[target.name] = _compile_ranks(backend, programs, target, scratch, settings)
            except DeviceRequiredError:
                # keep what the backend wrote (e.g. the ONNX for a GPU builder) at `out`, without a
                # manifest: it is not a runnable artifact
                swap_in(scratch, out, force)
                raise
            now = time.perf_counter()
            stage(f"codegen {target.name}", now - start)
            start = now
        weights = [
            _write_weights(scratch, program, [ranks[rank] for ranks in compiled.values()])
            for rank, program in enumerate(programs)
        ]
        digests = dict(weights)
        spec = source.vision.spec if source.vision is not None else None
        encoders = _compile_encoders(
            backend, built.encoder, spec, plan.targets, scratch, settings, len(programs)
        )
        if encoders:
            digests |= dict([encoders.pop("weights")])
        entries: dict[str, Any] = {}
        for target in plan.targets:
            ranks = compiled[target.name]
            rank_entries = [
                {"folder": code.folder, "weights": name}
                for code, (name, _) in zip(ranks, weights, strict=True)
            ]
            runs_here = mismatch(target) is None
            if runs_here:
                _probe(plan.backend, target, scratch, rank_entries, probe_ids)
            entries[target.name] = {
                "backend": backend.name,
                "backend_version": backend.version(),
                "target": target.name,
                "gpu_arch": target.gpu_arch,
                "folder": target.folder,
                "code": sorted({f for rank in ranks for f in rank.files}),
                "weights": weights[0][0],
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
            if encoders:
                entries[target.name]["encoder"] = encoders[target.name]
        now = time.perf_counter()
        stage("write weights", now - start)
        start = now

        config = source.config
        tokenizer_fields = fmt.write_tokenizer(scratch, built.tokenizer)
        compile_fields = plan.compiled()
        model_id = hashlib.sha256(
            f"{digest}\n{json.dumps(compile_fields, sort_keys=True)}".encode()
        ).hexdigest()
        manifest = fmt.seal(
            scratch,
            known=digests,
            manifest={
                "kiln_version": __version__,
                "model": {
                    "name": source.name,
                    "architecture": config.architecture,
                    "config": config.to_dict(),
                    "source_sha256": digest,
                    "model_id": model_id,
                    **_gguf_types(built),
                },
                "tokenizer": tokenizer_fields,
                "compile": {**compile_fields, "passes": [p.name for p in built.passes]},
                "limits": {"max_model_len": max_model_len, "max_num_seqs": limits.max_num_seqs},
                "targets": entries,
                **({"vision": source.vision.spec.to_dict()} if source.vision is not None else {}),
            },
        )
        swap_in(scratch, out, force, keep_existing)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch)
    stage("write", time.perf_counter() - start)
    return CompileResult(out, manifest, times)
