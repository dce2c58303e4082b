"""The compile cache under $KILN_HOME/artifacts: `serve`, `generate` and `kiln.LLM` start from a model by
loading its entry, compiling it there first where it is missing or damaged (in a child process:
compiler/apart.py). An entry is keyed by the
source's sha256 (compiler/source_digest.py), the decided options, the targets and the compiler's own
code; it is locked while it compiles, and the CACHE_ENTRIES most recent are kept."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

from kiln.backends.registry import get_backend
from kiln.compiler.apart import compile_apart
from kiln.compiler.plan import Plan
from kiln.compiler.source_digest import model_digest
from kiln.console import Progress
from kiln.frontend.pull import kiln_home, resolve_model
from kiln.runtime.artifact import ArtifactError, LoadedArtifact, is_artifact, load_artifact
from kiln.version import __version__

logger = logging.getLogger(__name__)

CACHE_ENTRIES = 4  # compiled models kept in the cache (each can be hundreds of MB)
_COMPILER_CODE = ("frontend", "ir", "passes", "backends", "compiler")

ProgressFor = Callable[
    [Path], AbstractContextManager[Progress | None]
]  # a display for a compile into a folder


def _tree_digest(root: Path, parts: tuple[str, ...], pattern: str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        path = root / part
        files = [path] if path.is_file() else sorted(path.rglob(pattern)) if path.is_dir() else []
        for file in files:
            if file.is_file():
                digest.update(file.relative_to(root).as_posix().encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


@functools.cache
def compiler_digest() -> str:
    """The sha256 of the code that turns a model into an artifact: a cache entry made by other code
    is never reused (the version number alone does not change between commits)."""
    return _tree_digest(Path(__file__).resolve().parents[1], _COMPILER_CODE, "*.py")


def cache_key(plan: Plan) -> str:
    logs = plan.tuning_logs
    key_parts = {
        "source": model_digest(resolve_model(plan.model), plan.mmproj),
        "options": plan.compiled(),
        "targets": [t.name for t in plan.targets],
        "num_threads": plan.options.num_threads,
        "tuning_logs": _tree_digest(logs, (".",), "*") if logs is not None else None,
        "kiln": __version__,
        "compiler": compiler_digest(),
        "backend": get_backend(plan.backend).version(),
    }
    return hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:24]


def cache_folder(plan: Plan) -> Path:
    return kiln_home() / "artifacts" / cache_key(plan)


def verdicts_folder() -> Path:
    """Where loads remember which artifact files were already hashed (see runtime/artifact.py)."""
    return kiln_home() / "verified"


def load_or_compile(plan: Plan, progress_for: ProgressFor | None = None) -> LoadedArtifact:
    """`plan` compiled, from the cache, compiling it into the cache first where it is not there (or is
    damaged)."""
    folder = cache_folder(plan)
    with _entry_lock(folder):  # processes starting the same model at once compile it once
        if is_artifact(folder):
            try:
                return load_artifact(folder, verdicts=verdicts_folder())
            except ArtifactError as error:
                logger.warning("the cached artifact %s is damaged (%s); compiling it again", folder, error)
        damaged = is_artifact(folder)  # replace it; otherwise a concurrent compile's entry is as good as ours
        with progress_for(folder) if progress_for is not None else nullcontext() as progress:
            compile_apart(plan, folder, progress, keep_existing=not damaged)
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
