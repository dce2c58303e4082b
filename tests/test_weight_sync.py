"""examples/rl_loop.py as a user runs it: a trainer takes REINFORCE steps on a tiny Llama, pushes its
weights into `kiln serve --enable-weight-updates` over gloo (kiln.WeightSync) after each, and checks
that Kiln's greedy tokens are transformers' on the trainer's current weights: the reference backend
and TVM with int8 weights (each greedy token within 0.05 nats of transformers' best)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "rl_loop.py"


@pytest.mark.parametrize(("backend", "quantization"), [("reference", "none"), ("tvm", "int8")])
def test_the_rl_loop_example(backend: str, quantization: str) -> None:
    command = [sys.executable, str(EXAMPLE), "--backend", backend, "--quantization", quantization]
    result = subprocess.run([*command, "--steps", "2"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[2] for row in rows] == ["1", "2"]  # the weight versions pushed
    assert all(line.endswith("greedy as transformers") for line in result.stdout.splitlines()[1:3])
