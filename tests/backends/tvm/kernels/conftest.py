"""Makes gpu_on_cpu.py (the CUDA kernels' TIR run on the CPU) importable by the tests beside it
(pytest's importlib mode puts no test folder on sys.path)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
