"""The suite's per-test timeout (pytest-timeout, [tool.pytest.ini_options] in pyproject.toml): a test that
sleeps forever fails with a timeout naming it and its traceback, and the run goes on, the tests after it
in the same file included, alone and under pytest-xdist as `make test` runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT = Path(__file__).parents[1] / "pyproject.toml"

HANGING = """
import time

import pytest


def test_before():
    pass


@pytest.mark.timeout(2)
def test_sleeps_forever():
    while True:
        time.sleep(60)


def test_after_in_the_same_file():
    pass
"""
OTHER = """
def test_in_another_file():
    pass
"""


def test_the_timeout_is_configured_generous_and_by_signal() -> None:
    import tomllib

    options = tomllib.loads(PROJECT.read_text())["tool"]["pytest"]["ini_options"]
    # signal: the timed-out test alone fails; `thread` would end the process (the xdist worker, or the run)
    assert options["timeout_method"] == "signal" and options["timeout"] >= 600


@pytest.mark.parametrize("workers", [(), ("-n", "2", "--dist", "loadfile")], ids=["alone", "xdist"])
def test_a_test_that_sleeps_forever_fails_alone_and_the_run_goes_on(
    tmp_path: Path, workers: tuple[str, ...]
) -> None:
    (tmp_path / "test_hang.py").write_text(HANGING)
    (tmp_path / "test_other.py").write_text(OTHER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONBREAKPOINT"))}
    plugins = () if workers else ("-p", "no:xdist")
    command = [sys.executable, "-m", "pytest", "-c", str(PROJECT), "--rootdir", str(tmp_path)]
    command += ["-p", "no:cacheprovider", "-rA", *plugins, *workers, "test_hang.py", "test_other.py"]
    done = subprocess.run(
        command, cwd=tmp_path, env=env | {"COLUMNS": "200"}, capture_output=True, text=True, timeout=300
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-4000:]
    assert re.search(r"FAILED test_hang.py::test_sleeps_forever - Failed: Timeout \(>2.0s\)", output), output
    hung_at = r">\s+time.sleep\(60\)\nE\s+Failed: Timeout \(>2.0s\) from pytest-timeout."
    assert re.search(hung_at, output), output  # its traceback, ending where it hung
    passed = set(re.findall(r"^PASSED (\S+)", output, re.MULTILINE))
    assert passed == {
        "test_hang.py::test_before",
        "test_hang.py::test_after_in_the_same_file",
        "test_other.py::test_in_another_file",
    }, output
    assert re.search(r"\b1 failed, 3 passed\b", output), output[-2000:]
