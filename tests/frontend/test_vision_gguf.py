"""A SmolVLM-shaped model and a Gemma 3 (random weights, scripts/make_vlm.py) converted by llama.cpp's own
converter into a text GGUF and an `--mmproj` image-encoder GGUF, as llama-server users have them: Kiln
serves the pair and its greedy tokens for three images equal llama-server's (recorded by
bench/vision_peers.py --record in tests/fixtures/<family>_tiny_llama_cpp.json, with the sha256 of the
files it ran on) on the default path (TVM for this CPU; every backend's image path: test_vision.py)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from kiln.errors import ModelLoadError
from kiln.runtime.sampling_params import SamplingParams
from tests.conftest import load_script

pytest.importorskip("transformers")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_vlm.py"


def fixture_of(family: str) -> Path:
    return FIXTURES / f"{family}_tiny_llama_cpp.json"


def make_vlm() -> Any:
    return load_script(SCRIPT)


@pytest.fixture(scope="module")
def converted(
    tmp_path_factory: pytest.TempPathFactory, llama_cpp_source: Path
) -> Callable[[str], tuple[Path, Path, Path]]:
    """A function: a family's (HF directory, text GGUF, mmproj GGUF), the GGUFs llama-server ran on, made
    once."""
    made: dict[str, tuple[Path, Path, Path]] = {}

    def convert(family: str) -> tuple[Path, Path, Path]:
        if family in made:
            return made[family]
        maker = make_vlm()
        folder = tmp_path_factory.mktemp(family)
        maker.FAMILIES[family](folder / "hf", "tiny")
        text, mmproj = maker.convert(llama_cpp_source, folder / "hf", folder)
        recorded = json.loads(fixture_of(family).read_text())
        for file, key in ((text, "text_gguf_sha256"), (mmproj, "mmproj_gguf_sha256")):
            digest = hashlib.sha256(file.read_bytes()).hexdigest()
            assert digest == recorded[key], (
                f"{file.name} is not the file llama-server's tokens were recorded on: record them again "
                f"with `bench/vision_peers.py --family {family} --shape tiny --runs 3 --record "
                f"{fixture_of(family)}`"
            )
        made[family] = (folder / "hf", text, mmproj)
        return made[family]

    return convert


@pytest.fixture(scope="module", params=["smolvlm", "gemma3"])
def served(request: pytest.FixtureRequest, converted: Callable[[str], Any]) -> Iterator[tuple[str, Any]]:
    """(family, its GGUF pair served on the default path)."""
    from kiln.llm import LLM

    _, text, mmproj = converted(request.param)
    model = LLM(str(text), mmproj=str(mmproj), backend="tvm", show_progress=False)
    yield request.param, model
    model.close()


def test_greedy_tokens_equal_llama_servers(served: tuple[str, Any]) -> None:
    family, llm = served
    recorded = json.loads(fixture_of(family).read_text())
    params = SamplingParams(max_tokens=len(recorded["tokens"][0]), temperature=0, ignore_eos=True)
    for shown, expected in zip(recorded["images"], recorded["tokens"], strict=True):
        width, height = shown["size"]
        pixels = np.random.default_rng(shown["seed"]).integers(0, 255, (height, width, 3), dtype=np.uint8)
        content = [{"type": "image_pil", "image_pil": Image.fromarray(pixels)}]
        messages = [{"role": "user", "content": [*content, {"type": "text", "text": recorded["prompt"]}]}]
        assert llm.chat(messages, params).outputs[0].token_ids == expected


def test_mmproj_goes_with_a_gguf_model(converted: Callable[[str], tuple[Path, Path, Path]]) -> None:
    from kiln.frontend.load import load_model

    hf, _, mmproj = converted("smolvlm")
    with pytest.raises(ModelLoadError, match="--mmproj goes with a GGUF model file"):
        load_model(str(hf), mmproj)


def test_kiln_generate_with_an_image(
    converted: Callable[[str], tuple[Path, Path, Path]], tmp_path: Path
) -> None:
    """`kiln generate TEXT --mmproj MMPROJ --chat --image FILE` prints the greedy reply `LLM.chat` gives."""
    import subprocess
    import sys

    from kiln.llm import LLM

    _, text, mmproj = converted("smolvlm")
    recorded = json.loads(fixture_of("smolvlm").read_text())
    width, height = recorded["images"][0]["size"]
    pixels = np.random.default_rng(recorded["images"][0]["seed"]).integers(
        0, 255, (height, width, 3), dtype=np.uint8
    )
    Image.fromarray(pixels).save(tmp_path / "image.png")
    command = [sys.executable, "-m", "kiln.cli", "generate", str(text), "--mmproj", str(mmproj), "--chat"]
    command += [
        "--prompt",
        recorded["prompt"],
        "--image",
        str(tmp_path / "image.png"),
        "--backend",
        "reference",
    ]
    command += ["--max-tokens", "16", "--temperature", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    llm = LLM(str(text), mmproj=str(mmproj), backend="reference", show_progress=False)
    content = [{"type": "image_pil", "image_pil": Image.open(tmp_path / "image.png")}]
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": recorded["prompt"]}]}]
    reply = llm.chat(messages, SamplingParams(max_tokens=16, temperature=0)).outputs[0].text
    assert result.stdout.rstrip("\n") == reply
