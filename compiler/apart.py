"""A compile in a child process: the compile cache's misses compile here, so a process that serves a model
never holds what compiling needs (torch, TVM's compiler, the source's tensors: several times the
artifact's memory at 8B) and its memory after a first start is what a later start's is.

The child is `python -m kiln.compiler.apart`, started with the parent's interpreter and environment (not
multiprocessing: its `spawn` re-runs a script's unguarded top level, `fork` copies a process that may
hold threads). The plan goes to its stdin as a pickle; the stages it finishes and its outcome come back
over a pipe as pickles; its stderr is the parent's. The child exits when the parent's end of stdin
closes (between two of the compiler's calls), so a killed server leaves no compile running."""

from __future__ import annotations

import _thread
import os
import pickle
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kiln.compiler.plan import Plan
from kiln.console import Progress
from kiln.errors import KilnError


class CompileProcessError(KilnError):
    """The compiler process ended without an outcome (killed, out of memory, or kiln not importable)."""


@dataclass(frozen=True)
class _Job:
    plan: Plan
    folder: Path
    keep_existing: bool


@dataclass(frozen=True)
class _Stage:
    name: str
    took: float


@dataclass(frozen=True)
class _Failed:
    error: BaseException | None  # None: it could not be pickled; `text` says what it was
    text: str


def compile_apart(plan: Plan, folder: Path, progress: Progress | None, keep_existing: bool) -> None:
    """compiler.codegen.compile_model(plan, folder, ...) in a child process; its error is raised here."""
    read_end, write_end = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-m", "kiln.compiler.apart", str(write_end)],
        stdin=subprocess.PIPE,
        pass_fds=(write_end,),
    )
    os.close(write_end)
    assert child.stdin is not None
    failure: _Failed | None = None
    try:
        with os.fdopen(read_end, "rb") as events:
            child.stdin.write(pickle.dumps(_Job(plan, folder, keep_existing)))
            child.stdin.flush()
            while (event := _next_event(events)) is not None:
                if isinstance(event, _Stage) and progress is not None:
                    progress(event.name, event.took)
                elif isinstance(event, _Failed):
                    failure = event
    finally:
        child.stdin.close()  # the child's signal to stop, if it is still compiling
        returncode = child.wait()
    if failure is not None:
        raise failure.error if failure.error is not None else CompileProcessError(failure.text)
    if returncode != 0:
        raise CompileProcessError(
            f"compiling {plan.model} into {folder}: the compiler process exited with status {returncode} "
            "and no error",
            hint="its messages are above; a negative status is the signal that ended it (-9: likely out of "
            "memory)",
        )


def _next_event(events: BinaryIO) -> object | None:
    try:
        return pickle.load(events)
    except EOFError:
        return None


def _report(events: BinaryIO, event: object) -> None:
    pickle.dump(event, events)
    events.flush()


def _picklable(error: BaseException) -> BaseException | None:
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return None
    return error


def _stop_if_parent_leaves(done: threading.Event) -> None:
    while os.read(0, 4096):  # the raw descriptor: a daemon thread in sys.stdin's buffer aborts the exit
        pass
    if not done.is_set():
        _thread.interrupt_main()  # a KeyboardInterrupt in the compile, which removes its scratch folder


def _child(events_fd: int) -> None:
    from kiln.compiler.codegen import compile_model

    with os.fdopen(events_fd, "wb") as events:
        job: _Job = pickle.load(sys.stdin.buffer)
        done = threading.Event()  # set before the parent, seeing the events end, closes stdin
        threading.Thread(target=_stop_if_parent_leaves, args=(done,), daemon=True).start()
        try:
            compile_model(
                job.plan,
                job.folder,
                progress=lambda name, took: _report(events, _Stage(name, took)),
                keep_existing=job.keep_existing,
            )
        except BaseException as error:  # every failure goes back to the parent, which raises it
            if not isinstance(error, KilnError):
                traceback.print_exc()  # a bug's traceback is the child's; the parent's would end here
            text = error.one_line() if isinstance(error, KilnError) else f"{type(error).__name__}: {error}"
            _report(events, _Failed(_picklable(error), text))
            if not isinstance(error, Exception):
                raise
        finally:
            done.set()


if __name__ == "__main__":
    from kiln.compiler.apart import _child as child  # the events' classes, pickled under their module's name

    child(int(sys.argv[1]))
