"""The sha256 of a model source (a file, or every file of a directory by relative name), for the
compile cache's key and the manifest; each file hashed once (frontend/file_digest.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from kiln.frontend.file_digest import file_digest
from kiln.frontend.pull import digest_records


def source_digest(path: Path) -> str:
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        digest.update(file.relative_to(path if path.is_dir() else path.parent).as_posix().encode() + b"\0")
        digest.update(file_digest(file, digest_records()).encode())
    return digest.hexdigest()


def model_digest(model: Path, mmproj: Path | None = None) -> str:
    """The sha256 of a model's files and, where it has one, its separate image-encoder file."""
    digest = source_digest(model)
    if mmproj is None:
        return digest
    return hashlib.sha256(f"{digest}\n{source_digest(mmproj)}".encode()).hexdigest()
