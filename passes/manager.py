"""Run a pipeline of passes: verify after each (optionally), time each, dump IR before/after, and name
the failing pass with the passes that ran before it."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import KilnError
from kiln.ir import Program, print_graph
from kiln.passes.base import Pass, PassError, PassOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassRecord:
    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    changed: bool


@dataclass
class PassReport:
    records: list[PassRecord] = field(default_factory=list)

    def table(self) -> str:
        lines = [f"{'pass':<28}{'time ms':>9}{'nodes before':>14}{'nodes after':>13}  changed"]
        for r in self.records:
            changed = "yes" if r.changed else "no"
            lines.append(
                f"{r.name:<28}{r.seconds * 1000:>9.1f}{r.nodes_before:>14}{r.nodes_after:>13}  {changed}"
            )
        return "\n".join(lines)


class PassManager:
    def __init__(self, passes: Sequence[Pass], verify: bool = False, dump_dir: Path | None = None) -> None:
        self.passes = list(passes)
        self.verify = verify
        self.dump_dir = dump_dir

    def run(self, program: Program, options: PassOptions | None = None) -> tuple[Program, PassReport]:
        options = options or PassOptions()
        report = PassReport()
        if self.verify:
            program.verify()
        for index, current in enumerate(self.passes):
            self._dump(program, index, current.name, "before")
            before = len(program.graph.nodes)
            start = time.perf_counter()
            try:
                program, changed = current.run(program, options)
                if self.verify:
                    program.verify()
            except KilnError as error:
                ran = ", ".join(p.name for p in self.passes[:index]) or "none"
                raise PassError(
                    f"pass {current.name} failed: {error} (passes run before it: {ran})", hint=error.hint
                ) from error
            seconds = time.perf_counter() - start
            report.records.append(
                PassRecord(current.name, seconds, before, len(program.graph.nodes), changed)
            )
            logger.debug(
                "pass %s: %.1f ms, %d -> %d nodes",
                current.name,
                seconds * 1000,
                before,
                len(program.graph.nodes),
            )
            self._dump(program, index, current.name, "after")
        return program, report

    def _dump(self, program: Program, index: int, name: str, when: str) -> None:
        if self.dump_dir is None:
            return
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        (self.dump_dir / f"{index:02d}-{name}-{when}.ir").write_text(print_graph(program.graph))
