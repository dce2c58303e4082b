"""Each vision-language family (LLaVA-1.5, Idefics3 / SmolVLM, Gemma 3), a tiny random-weight model saved
by transformers and compiled whole (the encoder beside the step) by the reference, ONNX Runtime and TVM
(CPU) backends: the logits of every prompt position with one image and with two equal transformers'
within 1e-4 (float32, the KV cache too; the artifact's own encoder and step), and 16 greedy tokens
through `LLM.generate` are transformers' greedy tokens. Gemma 3's image tokens attend to one another
both ways (in its sliding layer too, within the window), as transformers' mask for token_type_ids has
it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from kiln.ir.step import SequenceSlice, build_step_inputs
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.vision import place_images

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
NUM_TOKENS = 16


def images(count: int) -> list[Image.Image]:
    rng = np.random.default_rng(count)
    return [
        Image.fromarray(rng.integers(0, 255, (40 + 9 * i, 50 - 7 * i, 3), dtype=np.uint8))
        for i in range(count)
    ]


class Reference:
    """transformers' model of a family and what it needs for a prompt: input ids and pixel inputs."""

    def __init__(self, family: str, folder: Path, save: Any) -> None:
        self.family = family
        self.folder = folder
        self.placeholder = "<start_of_image>" if family == "gemma3" else "<image>"
        if family == "llava":
            self.model = save(folder, with_tokenizer=True)
            self.processor = transformers.CLIPImageProcessor.from_pretrained(folder)
        elif family == "gemma3":
            self.model = save(folder)
            self.processor = transformers.Gemma3ImageProcessorPil.from_pretrained(folder)
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        else:
            self.model, self.processor = save(folder)

    def inputs(self, text: str, pictures: list[Image.Image]) -> dict[str, torch.Tensor]:
        """transformers' inputs for `text`, whose `<image>` words are the pictures' placeholders."""
        if self.family == "idefics3":
            batch = self.processor(text=[text], images=[pictures], return_tensors="pt")
            return {name: batch[name] for name in ("input_ids", "pixel_values", "pixel_attention_mask")}
        if self.family == "gemma3":  # Gemma3Processor's text for an image; its token types
            image = "\n\n<start_of_image>" + "<image_soft_token>" * 16 + "<end_of_image>\n\n"
            ids = self.tokenizer(text.replace("<image>", image), return_tensors="pt").input_ids
            return {
                "input_ids": ids,
                "token_type_ids": (ids == 299).long(),
                "pixel_values": self.processor(pictures, return_tensors="pt").pixel_values,
            }
        words = [f"t{i}" for i in range(1, 299)] + ["<image>"]
        ids = [
            i for word in text.split() for i in ([299] * 16 if word == "<image>" else [words.index(word) + 1])
        ]
        return {
            "input_ids": torch.tensor([ids]),
            "pixel_values": self.processor(pictures, return_tensors="pt").pixel_values,
        }

    def logits(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(**inputs).logits[0]

    def greedy(self, inputs: dict[str, torch.Tensor]) -> list[int]:
        ids = inputs["input_ids"][0].tolist()
        for _ in range(NUM_TOKENS):
            grown = {**inputs, "input_ids": torch.tensor([ids])}
            if "token_type_ids" in inputs:
                grown["token_type_ids"] = (grown["input_ids"] == 299).long()
            ids.append(int(self.logits(grown)[-1].argmax()))
        return ids[-NUM_TOKENS:]


@pytest.fixture(scope="module", params=["llava", "idefics3", "gemma3"])
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    folder = tmp_path_factory.mktemp(request.param)
    return Reference(request.param, folder, request.getfixturevalue(f"tiny_{request.param}"))


@pytest.fixture(scope="module", params=["reference", "onnxruntime", "tvm"])
def llm(request: pytest.FixtureRequest, reference: Reference) -> Iterator[Any]:
    from kiln.llm import LLM

    # float32 throughout: TVM's CPU default keeps the KV cache in float16 (1e-4 of Gemma 3's logits)
    options = {"kv_cache_dtype": "f32"} if request.param == "tvm" else {}
    model = LLM(str(reference.folder), backend=request.param, show_progress=False, **options)
    yield model
    model.close()


PROMPTS = {1: "t5 <image> t6 t7", 2: "t5 <image> t8 <image> t9"}


@pytest.mark.parametrize("count", [1, 2])
def test_logits_with_images_equal_transformers(reference: Reference, llm: Any, count: int) -> None:
    pictures = images(count)
    inputs = reference.inputs(PROMPTS[count], pictures)
    vision = llm.artifact.vision
    spec = vision.spec
    embeddings = [vision.embed(picture) for picture in pictures]
    prompt = PROMPTS[count].replace("<image>", reference.placeholder)
    ids = llm.get_tokenizer().encode(prompt, add_special_tokens=False)
    ids, positions = place_images(
        ids, [e.placeholder for e in embeddings], spec.image_token_id, spec.placeholder_id
    )
    assert ids == inputs["input_ids"][0].tolist()
    rows = np.concatenate([e.rows for e in embeddings])
    executable = llm.artifact.executable
    blocks = list(range(1, -(-len(ids) // 16) + 1))
    cache = executable.kv_cache_spec.allocate(len(blocks) + 1, 16)
    piece = SequenceSlice(ids, 0, blocks, range(len(ids)), positions.tolist(), rows)
    step = build_step_inputs([piece], 16, llm.artifact.vocab_size, spec.bidirectional)
    got = torch.from_numpy(executable.step(step, cache))
    expected = reference.logits(inputs)
    assert torch.allclose(got, expected, atol=TOLERANCE, rtol=0), float((got - expected).abs().max())


def test_greedy_tokens_equal_transformers(reference: Reference, llm: Any) -> None:
    pictures = images(2)
    expected = reference.greedy(reference.inputs(PROMPTS[2], pictures))
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    prompt = PROMPTS[2].replace("<image>", reference.placeholder)
    (output,) = llm.generate({"prompt": prompt, "multi_modal_data": {"image": pictures}}, params)
    assert output.outputs[0].token_ids == expected
