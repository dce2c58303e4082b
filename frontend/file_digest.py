"""A file's sha256, computed once: remembered in the process and in a folder of records by the file's
path, size and modification time, so a multi-GB model is hashed at most once per process, and not at
all while it is unchanged (a file rewritten in place keeps neither its size and time nor its record)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kiln.digests import sha256_file

_known: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) → sha256, this process's


def file_digest(file: Path, records: Path | None) -> str:
    """`file`'s sha256, hashed only where neither this process nor a record in `records` (None: none
    kept on disk) has it for the file's current size and modification time."""
    resolved = file.resolve()
    stat = resolved.stat()
    key = (str(resolved), stat.st_size, stat.st_mtime_ns)
    if key in _known:
        return _known[key]
    record = records / f"{hashlib.sha256(key[0].encode()).hexdigest()[:32]}.json" if records else None
    sha256 = _recorded(record, key) if record is not None else None
    if sha256 is None:
        sha256 = sha256_file(resolved)
        if record is not None:
            _remember(record, key, sha256)
    _known[key] = sha256
    return sha256


def _recorded(record: Path, key: tuple[str, int, int]) -> str | None:
    try:
        saved = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or (saved.get("path"), saved.get("size"), saved.get("mtime_ns")) != key:
        return None
    sha256 = saved.get("sha256")
    return sha256 if isinstance(sha256, str) else None


def _remember(record: Path, key: tuple[str, int, int], sha256: str) -> None:
    """Write the record whole (a temporary file renamed over it); where the folder cannot be written the
    digest is only remembered in the process."""
    path, size, mtime_ns = key
    text = json.dumps({"path": path, "size": size, "mtime_ns": mtime_ns, "sha256": sha256})
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        scratch = record.with_name(f"{record.name}.{os.getpid()}.tmp")
        scratch.write_text(text)
        scratch.replace(record)
    except OSError:
        return
