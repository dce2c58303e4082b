"""What the compiled TVM step assumes of the arrays it is handed, shared by the code that lays weights
out (layouts.py), loads them (executable.py) and stages a GPU step's inputs (staging.py)."""

from __future__ import annotations

ALIGNMENT = 64  # bytes: every array the compiled kernels read starts where their aligned loads want it


def stored_name(source: str, transform: str) -> str:
    """The artifact's name for weight `source` laid out by `transform` (layouts.py)."""
    return source if transform == "none" else f"{source}@{transform}"
