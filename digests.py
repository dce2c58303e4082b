"""The sha256 of a file, read in chunks: what an artifact's manifest records of each file, and what a
pulled model is checked by. A base module like errors.py: it imports nothing of ours, and every layer may
import it."""

from __future__ import annotations

import hashlib
from pathlib import Path

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """The sha256 of `path`'s bytes, read now."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
