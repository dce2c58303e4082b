"""Images in the engine (runtime/vision.py): placeholders expanded to an image's rows, the prefix cache
keyed by the image, each image encoded once per request however often the request is preempted or its
prefill is cut; and the offline API's shapes (`multi_modal_data`, `llm.chat` with image parts), on a tiny
random-weight LLaVA compiled for the reference backend."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.vision import ImageEmbedding, cache_key_ids, place_images, template_content

pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (30, 36, 3), dtype=np.uint8))


def test_one_placeholder_an_image_expands_to_its_ids() -> None:
    ids, positions = place_images([1, 9, 2, 9, 3], [(9, 9), (7, 9, 9, 9, 7)], image_token_id=9)
    assert ids == [1, 9, 9, 2, 7, 9, 9, 9, 7, 3] and positions.tolist() == [1, 2, 5, 6, 7]
    already, at = place_images(ids, [(9, 9), (7, 9, 9, 9, 7)], image_token_id=9)  # expanded already
    assert already == ids and at.tolist() == positions.tolist()
    with pytest.raises(ValueError, match=r"2 image placeholder tokens .* for 3 images"):
        place_images([1, 9, 9], [(9,) * 4] * 3, image_token_id=9)


def test_the_cache_keys_an_images_tokens_by_its_content() -> None:
    rows = np.zeros((2, 4), np.float32)
    ids, at = place_images([1, 9, 2], [(9, 9)], 9)
    one = cache_key_ids(ids, at, [ImageEmbedding(rows, b"a" * 32, (9, 9))])
    same = cache_key_ids(ids, at, [ImageEmbedding(rows + 1, b"a" * 32, (9, 9))])
    other = cache_key_ids(ids, at, [ImageEmbedding(rows, b"b" * 32, (9, 9))])
    assert one == same != other and one[0] == 1 and one[3] == 2 and min(one) < 0


def test_template_content_as_the_template_reads_it() -> None:
    assert template_content([None, "hi"], "<image>", "{{ part['type'] == 'image' }}") == [
        {"type": "image"},
        {"type": "text", "text": "hi"},
    ]
    assert template_content(["hi", None, None], "<image>", "{{ content }}") == "<image>\n<image>\nhi"


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory, tiny_llava) -> Any:
    from kiln.llm import LLM

    folder = tmp_path_factory.mktemp("tiny-llava")
    tiny_llava(folder, with_tokenizer=True)
    model = LLM(str(folder), backend="reference", show_progress=False, num_blocks=64)
    yield model
    model.close()


def counting_encoder(llm: Any) -> list[int]:
    """Count the encoder's calls from now on."""
    calls: list[int] = []
    encoder = llm.artifact.vision.encoder
    encode = type(encoder).encode

    def counted(inputs: Any) -> Any:
        calls.append(1)
        return encode(encoder, inputs)

    encoder.encode = counted
    return calls


def test_preempted_and_cut_prefills_give_the_same_tokens_and_encode_once(llm: Any, tiny_llava) -> None:
    from kiln.llm import LLM

    prompts = [
        {"prompt_token_ids": [5, 299, 6, 299, 7], "multi_modal_data": {"image": [image(1), image(2)]}},
        {"prompt_token_ids": [8, 9, 299, 10], "multi_modal_data": {"image": image(3)}},
    ]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    # 5 blocks of 4 tokens for two prompts of ~40 tokens: preempted; 6 tokens a step: images cut
    tight = LLM(
        llm.options.model,
        backend="reference",
        show_progress=False,
        num_blocks=16,
        block_size=4,
        max_num_batched_tokens=6,
    )
    calls = counting_encoder(tight)
    outputs = tight.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert len(calls) == 3  # one per image, however often a request was preempted


def test_chat_with_image_parts_equals_multi_modal_data(llm: Any) -> None:
    picture = image(7)
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    url = f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "t5 t6"}]}],
        add_generation_prompt=True,
    )
    prompt = {"prompt": text, "multi_modal_data": {"image": picture}}
    expected = llm.generate(prompt, GREEDY)[0].outputs[0].token_ids
    for part in (
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image_pil", "image_pil": picture},
    ):
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "t5 t6"}]}]
        assert llm.chat(messages, GREEDY).outputs[0].token_ids == expected


def test_images_where_they_cannot_go_are_refused(llm: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"1 image placeholder tokens .* for 2 images"):
        llm.generate({"prompt_token_ids": [5, 299], "multi_modal_data": {"image": [image(1), image(2)]}})
    with pytest.raises(ValueError, match="a PIL image, not str"):
        llm.generate({"prompt_token_ids": [5, 299], "multi_modal_data": {"image": "cat.png"}})
    messages = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/hosts"}}]}
    ]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: file:// image URLs are refused"):
        llm.chat(messages)
