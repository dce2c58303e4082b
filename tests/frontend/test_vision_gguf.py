"""A SmolVLM-shaped model and a Gemma 3 (random weights, scripts/make_vlm.py) converted by llama.cpp's own
converter into a text GGUF and an `--mmproj` image-encoder GGUF, as llama-server users have them: Kiln
serves the pair and its greedy tokens for three images equal llama-server's (recorded by
bench/vision_peers.py --record in tests/fixtures/<family>_tiny_llama_cpp.json, with the sha256 of the
files it ran on), and each image's tokens differ from the others', on the default path (TVM for this
CPU: the whole-model check of these two families; their encoders on ONNX Runtime:
test_idefics3_vision.py, test_gemma3_vision.py)."""

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


@pytest.fixture(scope="module")
def served(converted: Callable[[str], Any]) -> Iterator[Callable[[str], Any]]:
    """A function: a family's GGUF pair served on the default path (TVM for this CPU), compiled once."""
    from kiln.llm import LLM

    models: dict[str, Any] = {}

    def serve(family: str) -> Any:
        if family not in models:
            _, text, mmproj = converted(family)
            models[family] = LLM(str(text), mmproj=str(mmproj), backend="tvm", show_progress=False)
        return models[family]

    yield serve
    for model in models.values():
        model.close()


def recorded_image(recorded: dict[str, Any], index: int) -> Image.Image:
    """The fixture's image `index`: one colour drawn from its seed (scripts/make_vlm.py `image`)."""
    shown = recorded["images"][index]
    return make_vlm().image(tuple(shown["size"]), shown["seed"])


@pytest.mark.parametrize("family", ["smolvlm", "gemma3"])
def test_greedy_tokens_equal_llama_servers(family: str, served: Callable[[str], Any]) -> None:
    recorded = json.loads(fixture_of(family).read_text())
    tokens = [tuple(t) for t in recorded["tokens"]]
    assert len(tokens) >= 3 and len(set(tokens)) == len(tokens), (
        f"{fixture_of(family).name}: two images have the same tokens, so this test cannot tell the images "
        "apart: record it again on images whose tokens differ (bench/vision_peers.py --seeds)"
    )
    llm = served(family)
    params = SamplingParams(max_tokens=len(recorded["tokens"][0]), temperature=0, ignore_eos=True)
    for index, expected in enumerate(recorded["tokens"]):
        content = [{"type": "image_pil", "image_pil": recorded_image(recorded, index)}]
        messages = [{"role": "user", "content": [*content, {"type": "text", "text": recorded["prompt"]}]}]
        assert llm.chat(messages, params).outputs[0].token_ids == expected, recorded["images"][index]


@pytest.mark.parametrize("family", ["smolvlm", "gemma3"])
def test_the_compiled_encoder_matches_the_interpreter(
    family: str, served: Callable[[str], Any], converted: Callable[[str], tuple[Path, Path, Path]]
) -> None:
    """The served artifact's image encoder (TVM for this CPU, compiled beside the step) gives the
    interpreter's rows for the encoder captured from the mmproj, on random pixels."""
    import importlib

    import torch

    from kiln.frontend.load import load_model
    from kiln.frontend.vision import encoder_program
    from kiln.ir.interpreter import interpret

    module = {"smolvlm": "idefics3_vision", "gemma3": "gemma3_vision"}[family]
    encoder_inputs = importlib.import_module(f"kiln.frontend.models.{module}").encoder_inputs
    _, text, mmproj = converted(family)
    vision = load_model(str(text), mmproj).vision
    assert vision is not None
    program = encoder_program(vision)
    pixels = torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(2)).numpy()
    inputs = encoder_inputs(pixels, vision.spec.patch_size)
    (expected,) = interpret(program.graph, program.weights, inputs)
    got = served(family).artifact.vision.encoder.encode(inputs)
    assert np.allclose(got, expected.numpy(), atol=1e-4, rtol=0), float(np.abs(got - expected.numpy()).max())


def test_mmproj_goes_with_a_gguf_model(converted: Callable[[str], tuple[Path, Path, Path]]) -> None:
    from kiln.frontend.load import load_model

    hf, _, mmproj = converted("smolvlm")
    with pytest.raises(ModelLoadError, match="--mmproj goes with a GGUF model file"):
        load_model(str(hf), mmproj)


def test_kiln_generate_with_an_image(
    converted: Callable[[str], tuple[Path, Path, Path]], served: Callable[[str], Any], tmp_path: Path
) -> None:
    """`kiln generate TEXT --mmproj MMPROJ --chat --image FILE` prints the greedy reply `LLM.chat` gives
    (on the artifact the tests above compiled: the compile cache's entry, loaded again by the CLI)."""
    import subprocess
    import sys

    _, text, mmproj = converted("smolvlm")
    recorded = json.loads(fixture_of("smolvlm").read_text())
    recorded_image(recorded, 0).save(tmp_path / "image.png")
    llm = served("smolvlm")
    command = [sys.executable, "-m", "kiln.cli", "generate", str(text), "--mmproj", str(mmproj), "--chat"]
    command += ["--prompt", recorded["prompt"], "--image", str(tmp_path / "image.png"), "--backend", "tvm"]
    command += ["--max-tokens", "16", "--temperature", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    content = [{"type": "image_pil", "image_pil": Image.open(tmp_path / "image.png")}]
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": recorded["prompt"]}]}]
    reply = llm.chat(messages, SamplingParams(max_tokens=16, temperature=0)).outputs[0].text
    assert result.stdout.rstrip("\n") == reply
