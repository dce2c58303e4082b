"""Tuning logs: MetaSchedule schedules for the CPU `decode` function's kernels (see `kiln tune`).

Layout (LAYOUT_VERSION 1), one folder per target CPU and per kernel workload:

    <logs>/cpu-<mcpu>/<workload hash>/meta.json                      what was tuned, and how it did
    <logs>/cpu-<mcpu>/<workload hash>/database_workload.json         MetaSchedule JSONDatabase: the
    <logs>/cpu-<mcpu>/<workload hash>/database_tuning_record.json    workload and its best record

A workload is a TE-made kernel (linear, qlinear, rms_norm, rope) specialized to the decode rows
(q = 1 block of 4, n = 4 rows) and not scheduled; its hash is the sha256 of its TVMScript text.
`kiln tune` keeps a record only when it beats the templated schedule (meta.json `kept`); a compile
applies kept records (no tuning: a trace replayed on the kernel) to `decode`'s kernels and marks them
"tuned". A log of another layout version or TVM version, or one that cannot be read, is skipped with a
warning: tuning logs never make a compile fail.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import tvm
from tvm import s_tir, tirx

from kiln.backends.base import BackendError

LAYOUT_VERSION = 1
TUNABLE_KINDS = ("linear", "qlinear", "rms_norm", "rope")
DECODE_ROWS = {"q": 1, "n": 4}  # the kernels' symbolic row extents in `decode` (tq = lq = 1 block of 4)
META = "meta.json"
DATABASE_FILES = ("database_workload.json", "database_tuning_record.json")


class TuningLogWarning(UserWarning):
    """A tuning log that a compile skips (another version, unreadable)."""


def tvm_version() -> str:
    return metadata.version("apache-tvm")


def target_folder(target: tvm.target.Target) -> str:
    """The logs' folder for an LLVM target: cpu-<mcpu>."""
    return f"cpu-{target.attrs['mcpu']}"


def specialize_rows(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The kernel with its symbolic row extent (q or n) fixed to the decode rows."""
    for param in func.params:
        shape = list(param.shape)
        symbolic = [i for i, d in enumerate(shape) if isinstance(d, tirx.Var) and d.name in DECODE_ROWS]
        if symbolic:
            for i in symbolic:
                shape[i] = tirx.IntImm("int64", DECODE_ROWS[shape[i].name])  # the kernels' rows are int64
            buffer = tirx.decl_buffer(
                shape,
                param.dtype,
                param.name,
                elem_offset=param.elem_offset,
                data_alignment=param.data_alignment,
                offset_factor=param.offset_factor,
            )
            return func.specialize({param: buffer})
    return func


def workload_module(func: tirx.PrimFunc) -> tvm.IRModule:
    """The one-function module MetaSchedule tunes and its database keys (normalized as tune_tir does)."""
    return tvm.IRModule({"main": func.with_attr("global_symbol", "main").with_attr("tirx.noalias", True)})


def workload_hash(func: tirx.PrimFunc) -> str:
    return hashlib.sha256(workload_module(func).script().encode()).hexdigest()


@dataclass
class Workload:
    """A tunable kernel of `decode`: the generic kernel (what `step` runs) and its decode specialization."""

    kind: str
    key: tuple[Any, ...]
    info: dict[str, Any]
    generic: tirx.PrimFunc  # unscheduled, symbolic rows
    func: tirx.PrimFunc  # unscheduled, decode rows
    digest: str

    @classmethod
    def of(cls, kind: str, key: tuple[Any, ...], generic: tirx.PrimFunc, info: dict[str, Any]) -> Workload:
        func = specialize_rows(generic)
        return cls(kind, key, info, generic, func, workload_hash(func))


def decode_workloads(graph: Any, target: tvm.target.Target | None = None) -> list[Workload]:
    """The distinct tunable kernels of the graph's CPU `decode` function for `target`, in lowering
    order (the quantized linears are hand-written where the target has integer dot products)."""
    from kiln.backends.tvm import cpu
    from kiln.backends.tvm.lowering import lower_graph

    found: dict[str, Workload] = {}

    def record(
        kind: str, key: tuple[Any, ...], generic: tirx.PrimFunc, info: dict[str, Any]
    ) -> tuple[tirx.PrimFunc, str] | None:
        if kind in TUNABLE_KINDS:
            workload = Workload.of(kind, key, generic, info)
            found.setdefault(workload.digest, workload)
        return None

    isa = cpu.int_dot_isa(target) if target is not None else None
    lower_graph(graph, "cpu", cpu.schedule_cpu, decode=True, decode_kernels=record, int_dot_isa=isa)
    return list(found.values())


def _read_meta(folder: Path) -> dict[str, Any]:
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise BackendError(f"{folder / META}: cannot read it ({error})") from None
    if not isinstance(meta, dict):
        raise BackendError(f"{folder / META}: not a JSON object")
    if meta.get("layout_version") != LAYOUT_VERSION:
        raise BackendError(
            f"{folder / META}: layout version {meta.get('layout_version')}, "
            f"this kiln reads version {LAYOUT_VERSION}",
            hint="regenerate it with `kiln tune`",
        )
    if meta.get("tvm_version") != tvm_version():
        raise BackendError(
            f"{folder / META}: tuned with TVM {meta.get('tvm_version')}, this is TVM {tvm_version()}",
            hint="regenerate it with `kiln tune`",
        )
    return meta


def _best_schedule(folder: Path, func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Replay the database's best trace on `func` (the decode-specialized unscheduled kernel)."""
    from tvm.s_tir import meta_schedule as ms

    missing = [name for name in DATABASE_FILES if not (folder / name).is_file()]
    if missing:
        raise BackendError(f"{folder}: no {', '.join(missing)}")
    mod = workload_module(func)
    try:
        database = ms.database.JSONDatabase(
            str(folder / DATABASE_FILES[0]), str(folder / DATABASE_FILES[1]), allow_missing=False
        )
        if not database.has_workload(mod):
            raise BackendError(f"{folder}: the database holds another workload than this kernel")
        records = database.get_top_k(database.commit_workload(mod), 1)
        if not records:
            raise BackendError(f"{folder}: the database has no tuning record")
        schedule = s_tir.Schedule(mod)
        records[0].trace.apply_to_schedule(schedule, remove_postproc=False)
    except BackendError:
        raise
    except Exception as error:  # a TVM error: the JSON does not parse, the trace does not apply
        last_line = (str(error).strip().splitlines() or [type(error).__name__])[-1]
        raise BackendError(f"{folder}: cannot use the database ({last_line})") from None
    return schedule.mod["main"].with_attr("tirx.is_scheduled", True)


class TuningLogs:
    """The kept records under <logs>/cpu-<mcpu>/, applied to `decode`'s kernels (a `DecodeKernels`)."""

    def __init__(self, logs: Path | None, target: tvm.target.Target) -> None:
        self.folder = logs / target_folder(target) if logs is not None else None

    def __call__(
        self, kind: str, key: tuple[Any, ...], generic: tirx.PrimFunc, info: dict[str, Any]
    ) -> tuple[tirx.PrimFunc, str] | None:
        if self.folder is None or kind not in TUNABLE_KINDS or not self.folder.is_dir():
            return None
        func = specialize_rows(generic)
        folder = self.folder / workload_hash(func)[:16]
        if not folder.is_dir():
            return None
        try:
            if not _read_meta(folder).get("kept"):
                return None
            return _best_schedule(folder, func), "tuned"
        except BackendError as error:
            warnings.warn(
                f"tuning log skipped, kernel {kind} keeps its template: {error.one_line()}",
                TuningLogWarning,
                stacklevel=2,
            )
            return None


# --- tuning -------------------------------------------------------------------------------------------


def _random_args(func: tirx.PrimFunc, device: Any) -> list[Any]:
    generator = np.random.default_rng(0)
    args = []
    for param in func.params:
        shape = [int(d) for d in param.shape]
        dtype = str(param.dtype)
        if dtype.startswith("float"):
            array = generator.standard_normal(shape).astype(dtype)
        else:
            array = generator.integers(0, 100, shape).astype(dtype)
        args.append(tvm.runtime.tensor(array, device))
    return args


def measure(func: tirx.PrimFunc, target: tvm.target.Target, shapes_of: tirx.PrimFunc) -> float:
    """Best-of-5 seconds per call of a scheduled kernel, on arguments shaped as `shapes_of`'s."""
    library = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    device = tvm.cpu()
    args = _random_args(shapes_of, device)
    timer = library.jit().time_evaluator("main", device, number=10, repeat=5, min_repeat_ms=50)
    return float(min(timer(*args).results))


@contextmanager
def _workers_without_torch() -> Iterator[None]:
    """MetaSchedule's builder/runner workers import tvm_ffi, which tries `import torch` (seconds each on
    a loaded machine: workers time out). Put a `torch` that fails at once first on their path."""
    shim = Path(tempfile.mkdtemp(prefix="kiln-notorch-"))
    (shim / "torch").mkdir()
    (shim / "torch" / "__init__.py").write_text('raise ImportError("torch is kept out of tuning workers")\n')
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(shim) + (os.pathsep + before if before else "")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before
        shutil.rmtree(shim, ignore_errors=True)


def _import_tensor_intrinsics() -> None:
    """Import tvm.s_tir.tensor_intrin (MetaSchedule's TuneContext does) with a memo on inspect.getmodule.

    Each of its few hundred TVMScript functions calls inspect.stack(), which, for every frame whose
    file does not exist ("<frozen importlib._bootstrap>", ...), scans all of sys.modules; with torch
    loaded that took over 5 minutes here. For a frame the answer depends on its file name only."""
    import inspect
    import sys

    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    original = inspect.getmodule
    found: dict[str, Any] = {}

    def getmodule(obj: Any, _filename: str | None = None) -> Any:
        if _filename is None or not inspect.isframe(obj):
            return original(obj, _filename)
        if _filename not in found:
            found[_filename] = original(obj, _filename)
        return found[_filename]

    inspect.getmodule = getmodule
    try:
        import tvm.s_tir.tensor_intrin  # noqa: F401
    finally:
        inspect.getmodule = original


def _build_function() -> Callable[[Any, Any, Any], Any]:
    """MetaSchedule's default builder, less its `import tvm.s_tir.tensor_intrin` (a minute per worker on a
    loaded machine; our kernels use no tensor intrinsics). Made in a closure so that cloudpickle sends
    it by value: the workers import tvm only, never kiln."""

    def build(mod: Any, target: Any, _params: Any) -> Any:
        from tvm.driver import build as tvm_build
        from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

        return tvm_build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target)

    return build


def tune_workload(
    workload: Workload,
    target: tvm.target.Target,
    logs: Path,
    trials: int,
    seed: int = 0,
    keep_slower: bool = False,
) -> dict[str, Any]:
    """Tune one kernel with MetaSchedule; write its folder under logs/cpu-<mcpu>/; return its meta.
    The record is kept only if it runs faster than the templated schedule (or with `keep_slower`)."""
    from tvm.s_tir import meta_schedule as ms

    from kiln.backends.tvm import cpu

    folder = logs / target_folder(target) / workload.digest[:16]
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    mod = workload_module(workload.func)
    start = time.perf_counter()
    _import_tensor_intrinsics()
    ms_logger = logging.getLogger("tvm.s_tir.meta_schedule")
    if ms_logger.level == logging.NOTSET:  # MetaSchedule then prints DEBUG lines on stdout
        ms_logger.setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="kiln-tune-") as work, _workers_without_torch():
        database = ms.tune_tir(
            mod,
            target,
            work,
            max_trials_global=trials,
            max_trials_per_task=trials,
            num_trials_per_iter=min(trials, 64),
            builder=ms.builder.LocalBuilder(f_build=_build_function(), timeout_sec=120),
            runner=ms.runner.LocalRunner(timeout_sec=120),
            seed=seed,
        )
        records = database.get_top_k(database.commit_workload(mod), 1)
    tune_seconds = time.perf_counter() - start
    meta: dict[str, Any] = {
        "layout_version": LAYOUT_VERSION,
        "kind": workload.kind,
        "key": [repr(k) for k in workload.key],
        "workload_sha256": workload.digest,
        "tvm_version": tvm_version(),
        "target": {"mcpu": str(target.attrs["mcpu"]), "num_cores": int(target.attrs["num-cores"])},
        "trials": trials,
        "tune_seconds": round(tune_seconds, 1),
    }
    templated, _ = cpu.schedule_cpu(workload.kind, workload.generic, workload.info)
    meta["templated_us"] = round(measure(templated, target, workload.func) * 1e6, 3)
    if not records:
        meta |= {"kept": False, "tuned_us": None, "note": "no valid MetaSchedule record"}
    else:
        best = records[0]
        schedule = s_tir.Schedule(mod)
        best.trace.apply_to_schedule(schedule, remove_postproc=False)
        tuned_us = measure(schedule.mod["main"], target, workload.func) * 1e6
        meta |= {"tuned_us": round(tuned_us, 3), "kept": keep_slower or tuned_us < meta["templated_us"]}
        if meta["kept"]:  # a database with this workload and its best record only
            kept = ms.database.JSONDatabase(
                str(folder / DATABASE_FILES[0]), str(folder / DATABASE_FILES[1]), allow_missing=True
            )
            entry = kept.commit_workload(mod)
            kept.commit_tuning_record(
                ms.database.TuningRecord(best.trace, entry, best.run_secs, target, best.args_info)
            )
    (folder / META).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return meta
