"""Image chat through `kiln serve` with the `openai` client: a tiny random-weight LLaVA (transformers)
compiled by the default path (TVM for this CPU, its encoder beside the step code), its greedy replies
equal transformers' on the same image and prompt, streamed and not; the same image and prompt again hit
the prefix cache and another image does not; every bad image is a 400 naming the part, and the server
keeps serving."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.server.conftest import ServerProcess

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 12


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def random_image(seed: int, size: tuple[int, int] = (40, 33)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


class TinyLlava:
    """The tiny LLaVA on disk, and transformers' greedy continuation of a chat with images."""

    def __init__(self, folder: Path, model: Any) -> None:
        self.folder = folder
        self.model = model
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        self.processor = transformers.CLIPImageProcessor.from_pretrained(folder)

    def greedy(self, text: str, images: list[Image.Image]) -> str:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        expanded = [t for token in ids for t in ([token] * 16 if token == 299 else [token])]
        pixels = self.processor(images, return_tensors="pt").pixel_values
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                logits = self.model(input_ids=torch.tensor([expanded]), pixel_values=pixels).logits
                expanded.append(int(logits[0, -1].argmax()))
        return self.tokenizer.decode(expanded[-MAX_TOKENS:])


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory, tiny_llava) -> TinyLlava:
    folder = tmp_path_factory.mktemp("tiny-llava")
    return TinyLlava(folder, tiny_llava(folder, with_tokenizer=True))


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(png_bytes(random_image(5)))
    return folder


@pytest.fixture(scope="module")
def server(llava: TinyLlava, media: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        llava.folder,
        "--allowed-local-media-path",
        str(media),
        "--limit-mm-per-prompt",
        json.dumps({"image": 2}),
        start_timeout_s=900,
    )
    yield process
    process.stop()


def chat(server: ServerProcess, content: list[dict[str, Any]], **kwargs: Any) -> Any:
    return server.client().chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        **kwargs,
    )


def test_the_model_lists_image_input(server: ServerProcess) -> None:
    (card,) = server.client().models.list().data
    assert card.model_extra["input_modalities"] == ["text", "image"]


def test_an_image_chat_equals_transformers_streamed_and_not(server: ServerProcess, llava: TinyLlava) -> None:
    image = random_image(1)
    content = [image_part(data_url(png_bytes(image))), {"type": "text", "text": "t5 t6"}]
    expected = llava.greedy("t5 t6", [image])
    reply = chat(server, content)
    assert reply.choices[0].message.content.strip() == expected  # (the tokenizer's words: spaces before)
    assert reply.usage.prompt_tokens > 16  # the image's 16 tokens and the text's
    stream = chat(server, content, stream=True)
    assert (
        "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices).strip() == expected
    )


def test_two_images_in_one_message(server: ServerProcess, llava: TinyLlava, media: Path) -> None:
    first, second = random_image(2), Image.open(media / "cat.png")
    content = [
        image_part(data_url(png_bytes(first))),
        image_part((media / "cat.png").as_uri()),
        {"type": "text", "text": "t7 t8"},
    ]
    reply = chat(server, content).choices[0].message.content
    assert reply.strip() == llava.greedy("t7 t8", [first, second])


def test_the_same_image_and_prompt_reuse_the_prefix_cache_and_another_image_does_not(
    server: ServerProcess,
) -> None:
    def hits() -> float:
        return server.metrics()["kiln:prefix_cache_hits_total"]

    text = {"type": "text", "text": " ".join(f"t{i}" for i in range(10, 60))}  # blocks past the image
    image = image_part(data_url(png_bytes(random_image(3))))
    chat(server, [image, text])
    before = hits()
    chat(server, [image, text])
    reused = hits() - before
    assert reused >= 48  # the image's block and the text's after it
    other = image_part(data_url(png_bytes(random_image(4))))
    before = hits()
    chat(server, [other, text])
    assert hits() - before < 16  # at most the block before the image (there is none): nothing
    prompts = server.post("/tokenize", json={"messages": [{"role": "user", "content": [image, text]}]})
    assert prompts.status_code == 200 and prompts.json()["tokens"].count(299) == 16


BAD_PARTS = [
    (image_part(data_url(b"not an image")), "Pillow can read"),
    (image_part(data_url(b"hello", "text/plain")), "text/plain"),
    (image_part("http://example.com/cat.png"), "allowed-media-domains"),
    (image_part("file:///etc/passwd"), "allowed-local-media-path"),
    (image_part(data_url(png_bytes(Image.new("1", (5000, 4000))))), "pixels"),
]


@pytest.mark.parametrize(("part", "said"), BAD_PARTS, ids=["undecodable", "type", "http", "file", "bomb"])
def test_a_bad_image_is_a_400_naming_the_part(server: ServerProcess, part: dict[str, Any], said: str) -> None:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "t5"}, part]}],
    }
    response = server.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1]" and said in error["message"], error
    assert server.post("/tokenize", json={"prompt": "t5"}).status_code == 200  # still serving


def test_more_images_than_the_limit_is_a_400(server: ServerProcess) -> None:
    image = image_part(data_url(png_bytes(random_image(6))))
    body = {"model": server.model, "messages": [{"role": "user", "content": [image, image, image]}]}
    response = server.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[2]" and "limit-mm-per-prompt" in error["message"]
