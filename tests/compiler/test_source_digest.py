"""A model source is hashed at most once per process, and not at all while its recorded size and
modification time match; `kiln pull` checks a cached model the same way."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from kiln.compiler.source_digest import source_digest
from kiln.frontend import file_digest


@pytest.fixture
def hashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files read to hash them, in a fresh KILN_HOME and with nothing remembered in the process."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(file_digest, "_known", {})
    files: list[Path] = []
    real = file_digest.sha256_file

    def counted(path: Path) -> str:
        files.append(path)
        return real(path)

    monkeypatch.setattr(file_digest, "sha256_file", counted)
    return files


def test_a_file_is_hashed_once_and_then_not_while_unchanged(
    tmp_path: Path, hashed: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(1000))
    first = source_digest(model)
    assert source_digest(model) == first and len(hashed) == 1  # once per process
    monkeypatch.setattr(file_digest, "_known", {})  # a new process: the record on disk answers
    assert source_digest(model) == first and len(hashed) == 1
    model.write_bytes(b"GGUF" + bytes(999) + b"\1")  # changed in place: hashed again
    os.utime(model, ns=(1, 1))
    assert source_digest(model) != first and len(hashed) == 2
    assert file_digest.file_digest(model, None) == hashlib.sha256(model.read_bytes()).hexdigest()


def test_a_start_from_a_model_name_hashes_its_gguf_at_most_once(
    smollm2_gguf_path: Path, hashed: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pull`'s check, the plan's header read and the cache key all reuse one hash."""
    from kiln.compiler import ModelOptions, resolve
    from kiln.compiler.cache import cache_key

    monkeypatch.setenv("KILN_HOME", str(smollm2_gguf_path.parents[2]))
    plan = resolve(ModelOptions("smollm2-135m-instruct"))
    cache_key(plan)
    cache_key(plan)
    assert len(hashed) <= 1
    monkeypatch.setattr(file_digest, "_known", {})
    cache_key(resolve(ModelOptions("smollm2-135m-instruct")))  # the next process: nothing hashed
    assert len(hashed) <= 1
