"""What the commands show a person while they work: stage progress, with rich on a terminal and one
plain line per stage elsewhere (logs, CI, pipes)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

Progress = Callable[[str, float], None]  # (stage that just ended, seconds it took)


def _done(stages: list[str], stage: str) -> int:
    """How many of `stages` are done once `stage` ends (all of them for a stage not listed)."""
    return stages.index(stage) + 1 if stage in stages else len(stages)


def plain_line(stages: list[str], stage: str, seconds: float) -> str:
    done = _done(stages, stage)
    bar = "#" * done + "." * (len(stages) - done)
    return f"[{bar}] {stage:<24} {seconds:6.2f} s"


@contextmanager
def stage_progress(title: str, stages: list[str], stream: TextIO | None = None) -> Iterator[Progress]:
    """A progress callback for `stages` (called as each one ends), shown under `title`."""
    stream = stream or sys.stderr
    if not stream.isatty():  # the title comes with the first stage's line: a failure before it is one line

        def line(stage: str, seconds: float) -> None:
            if stage == stages[0]:
                print(title, file=stream)
            print(plain_line(stages, stage, seconds), file=stream, flush=True)

        yield line
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    console = Console(file=stream)
    console.print(title)
    columns = (SpinnerColumn(), TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=False) as display:
        task = display.add_task(stages[0], total=len(stages))

        def advance(stage: str, seconds: float) -> None:
            display.console.print(f"  {stage:<24} {seconds:6.2f} s")
            done = _done(stages, stage)
            following = stages[done] if done < len(stages) else "done"
            display.update(task, completed=done, description=following)

        yield advance
