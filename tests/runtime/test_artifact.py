"""Loading refuses a damaged, foreign or mismatched artifact, naming the cause."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from kiln.runtime.artifact import ArtifactError, is_artifact, load_artifact, probe_logits, seal


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, tiny_hf_dir) -> Path:
    from kiln.compiler import ModelOptions, compile_model, resolve

    out = tmp_path_factory.mktemp("artifact") / "tiny"
    compile_model(resolve(ModelOptions(str(tiny_hf_dir), backend="reference")), out)
    return out


def _copy(compiled: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(compiled, copy)
    return copy


def _edit_manifest(folder: Path, change) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    del manifest["files"]
    seal(folder, manifest)  # checksums stay right: only the edited field is wrong


def test_a_good_artifact_loads_and_matches_its_probe(compiled: Path) -> None:
    assert is_artifact(compiled)
    artifact = load_artifact(compiled)
    now, recorded = probe_logits(artifact)
    assert np.array_equal(now, recorded)
    assert artifact.target.name == "cpu" and artifact.max_model_len == 128


def test_tampered_weights_are_refused_naming_the_file(compiled: Path, tmp_path: Path) -> None:
    copy = _copy(compiled, tmp_path)
    (weights,) = (copy / "weights").iterdir()
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=rf"checksum mismatch for weights/{weights.name}"):
        load_artifact(copy)


def test_verdicts_skip_hashing_unchanged_files_and_still_catch_tampering(
    compiled: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from kiln.runtime import artifact as fmt

    copy, verdicts = _copy(compiled, tmp_path), tmp_path / "verdicts"
    hashed: list[Path] = []
    real_sha256 = fmt.sha256_file
    monkeypatch.setattr(fmt, "sha256_file", lambda path: hashed.append(path) or real_sha256(path))
    load_artifact(copy, verdicts=verdicts)
    files = len(json.loads((copy / "manifest.json").read_text())["files"])
    assert len(hashed) == files and len(list(verdicts.iterdir())) == 1
    hashed.clear()
    load_artifact(copy, verdicts=verdicts)
    assert hashed == []  # every file unchanged since its verdict
    (weights,) = (copy / "weights").iterdir()
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size and mtime: ctime moved
    with pytest.raises(ArtifactError, match=rf"checksum mismatch for weights/{weights.name}"):
        load_artifact(copy, verdicts=verdicts)
    assert hashed == [weights]


def test_a_missing_file_is_named(compiled: Path, tmp_path: Path) -> None:
    copy = _copy(compiled, tmp_path)
    (copy / "cpu" / "graph.json").unlink()
    with pytest.raises(ArtifactError, match=r"file cpu/graph\.json is missing"):
        load_artifact(copy)


def test_a_truncated_manifest_is_refused(compiled: Path, tmp_path: Path) -> None:
    copy = _copy(compiled, tmp_path)
    text = (copy / "manifest.json").read_text()
    (copy / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(ArtifactError, match="manifest is truncated or corrupt"):
        load_artifact(copy)


def test_an_unknown_schema_version_is_refused(compiled: Path, tmp_path: Path) -> None:
    copy = _copy(compiled, tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="unknown schema version 99"):
        load_artifact(copy)


def test_a_foreign_gpu_arch_is_refused(compiled: Path, tmp_path: Path) -> None:
    copy = _copy(compiled, tmp_path)
    shutil.move(copy / "cpu", copy / "cuda-sm_90")

    def to_gpu(manifest: dict) -> None:
        entry = manifest["targets"].pop("cpu")
        entry.update(target="cuda:sm_90", gpu_arch="sm_90", folder="cuda-sm_90")
        entry["probe"]["logits_file"] = "cuda-sm_90/probe.safetensors"
        manifest["targets"]["cuda:sm_90"] = entry

    _edit_manifest(copy, to_gpu)
    from kiln.backends.targets import host_gpu_arch

    expected = "has no NVIDIA GPU" if host_gpu_arch() is None else "but this machine's GPU is"
    if host_gpu_arch() == "sm_90":
        pytest.skip("this machine's GPU is sm_90, the arch the test pretends is foreign")
    with pytest.raises(ArtifactError, match=rf"for cuda:sm_90 \(sm_90\).*{expected}|sm_90.*{expected}"):
        load_artifact(copy)


def test_another_backend_version_is_refused(compiled: Path, tmp_path: Path) -> None:
    copy = _copy(compiled, tmp_path)
    _edit_manifest(copy, lambda m: m["targets"]["cpu"].update(backend_version="torch-1.0.0"))
    with pytest.raises(ArtifactError, match=r"built with reference torch-1\.0\.0, this machine has torch-"):
        load_artifact(copy)


def test_a_folder_that_is_not_an_artifact(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match=r"no manifest\.json"):
        load_artifact(tmp_path)


def test_a_cache_compile_keeps_an_entry_that_appeared_meanwhile(
    compiled: Path, tiny_hf_dir: Path, tmp_path: Path
) -> None:
    from kiln.compiler import ModelOptions, compile_model, resolve

    out = _copy(compiled, tmp_path)
    (out / "theirs.txt").write_text("another process finished first")
    plan = resolve(ModelOptions(str(tiny_hf_dir), backend="reference"))
    compile_model(plan, out, keep_existing=True)
    assert (out / "theirs.txt").is_file()
    compile_model(plan, out)
    assert not (out / "theirs.txt").exists() and is_artifact(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]  # no scratch or old folder left
