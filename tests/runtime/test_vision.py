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

from kiln.ir.step import image_spans
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import PromptImages
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


def test_a_placeholder_other_than_the_image_token_expands_around_it() -> None:
    gemma_like = (5, 9, 9, 6)  # start, the image's two rows, end
    ids, positions = place_images([1, 5, 2], [gemma_like], image_token_id=9, placeholder_id=5)
    assert ids == [1, 5, 9, 9, 6, 2] and positions.tolist() == [2, 3]
    assert place_images(ids, [gemma_like], 9, 5)[0] == ids  # expanded already
    with pytest.raises(ValueError, match=r"0 image placeholder tokens \(id 5\) for 1 images"):
        place_images([1, 9, 2], [gemma_like], 9, 5)


def test_a_chunk_holds_whole_the_images_that_attend_both_ways() -> None:
    positions = np.array([2, 3, 4, 8, 9], np.int64)
    spans = image_spans(positions)
    assert spans == ((2, 5), (8, 10))
    images = PromptImages(np.zeros((5, 2), np.float32), positions, [], spans)
    assert images.chunk_end(0, 3) == 2  # ends before the image it would cut
    assert images.chunk_end(3, 4) == 5  # starts inside it (cached up to there): to its end
    assert images.chunk_end(0, 5) == 5 and images.chunk_end(5, 9) == 8


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


def test_gemma3_images_are_never_cut_and_give_the_same_tokens(tmp_path: Path, tiny_gemma3) -> None:
    """Gemma 3's image tokens attend both ways: with 6 tokens a step (less than an image's 16), every
    chunk holds whole the image it touches, and the tokens are those of one step."""
    from kiln.llm import LLM

    tiny_gemma3(tmp_path)
    prompt = {"prompt": "t5 <start_of_image> t6 t7", "multi_modal_data": {"image": image(4)}}
    image_span = (2, 18)  # t5, the start token, then the image's 16 tokens
    whole = LLM(str(tmp_path), backend="reference", show_progress=False, num_blocks=64)
    expected = whole.generate(prompt, GREEDY)[0].outputs[0].token_ids
    whole.close()
    tight = LLM(str(tmp_path), backend="reference", show_progress=False, max_num_batched_tokens=6)
    schedule = tight.engine.scheduler.schedule
    chunks: list[tuple[int, int]] = []

    def recorded() -> Any:
        output = schedule()
        chunks.extend((chunk.start, chunk.start + chunk.num_new_tokens) for chunk in output.chunks)
        return output

    tight.engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    assert tight.generate(prompt, GREEDY)[0].outputs[0].token_ids == expected
    tight.close()
    assert (2, 18) in chunks  # the image in one step, past the budget
    assert not any(image_span[0] < end < image_span[1] for _, end in chunks)
