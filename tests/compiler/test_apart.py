"""The compile cache's child process (compiler/apart.py): stages and errors cross back to the caller."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.compiler import ModelOptions, compile_stages, resolve
from kiln.compiler.apart import compile_apart
from kiln.compiler.output import OutputError
from kiln.runtime.artifact import is_artifact


def test_a_compile_in_a_child_reports_each_stage_and_writes_the_artifact(
    tmp_path: Path, tiny_hf_dir: Path
) -> None:
    plan = resolve(ModelOptions(str(tiny_hf_dir), backend="reference"))
    stages: list[tuple[str, float]] = []
    compile_apart(plan, tmp_path / "art", lambda name, took: stages.append((name, took)), keep_existing=False)
    assert [name for name, _ in stages] == compile_stages(plan.targets)
    assert all(took >= 0 for _, took in stages)
    assert is_artifact(tmp_path / "art")


def test_the_childs_error_is_raised_here_with_its_hint(tmp_path: Path, tiny_hf_dir: Path) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("a user's file")
    plan = resolve(ModelOptions(str(tiny_hf_dir), backend="reference"))
    with pytest.raises(OutputError, match="exists and is a folder that is not a Kiln artifact") as raised:
        compile_apart(plan, taken, None, keep_existing=False)
    assert raised.value.hint is not None and "--force" in raised.value.hint
    assert (taken / "notes.txt").read_text() == "a user's file"


def test_a_killed_parent_stops_the_compile_and_leaves_no_scratch(tmp_path: Path, tiny_hf_dir: Path) -> None:
    parent_code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from kiln.compiler import ModelOptions, resolve\n"
        "from kiln.compiler.apart import compile_apart\n"
        "def stage(name, took):\n"
        "    print(name, flush=True)\n"
        "    if name == 'load':\n"
        "        sys.stdin.read()  # held here until the test kills this process\n"
        f"plan = resolve(ModelOptions({str(tiny_hf_dir)!r}, backend='reference'))\n"
        f"compile_apart(plan, Path({str(tmp_path / 'art')!r}), stage, keep_existing=False)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None and parent.stdout.readline().strip() == "load"
    children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
    (child_pid,) = [int(pid) for pid in children]
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 120
    while Path(f"/proc/{child_pid}").exists() and _state(child_pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{child_pid}").exists() or _state(child_pid) == "Z", "the compile went on"
    assert list(tmp_path.iterdir()) == [], "the compile left files behind"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
