"""The incremental detokenizer on SmolLM2's byte-level BPE and on a small SentencePiece vocabulary."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.frontend.gguf_loader import load_gguf
from kiln.frontend.gguf_tokenizer import tokenizer_info_from_gguf
from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.tokenizer import Tokenizer

FFFD = "\ufffd"
TEXTS = [
    " Hello 👨‍👩‍👧 world, 日本語のテキスト! Zürich, café, naïve. 🤖🎉",
    "Привет, мир! مرحبا नमस्ते 中文字符。 ❤️ 1234",
    "\n\n  def f(x):\n\treturn {'é': [1, 2]}  # 🐍",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_dict(dataclasses.asdict(load_gguf(smollm2_gguf_path).tokenizer))


def _stream(detokenizer: IncrementalDetokenizer, token_ids: Sequence[int]) -> tuple[list[str], str | None]:
    """Feed the tokens one by one, taking a delta after each and after finish(): (deltas, stop)."""
    deltas, stop = [], None
    for token_id in token_ids:
        stop = detokenizer.add_token(token_id)
        deltas.append(detokenizer.take_delta())
        if stop is not None:
            break
    detokenizer.finish()
    deltas.append(detokenizer.take_delta())
    assert "".join(deltas) == detokenizer.text
    return deltas, stop


def _random_text(rng: random.Random) -> str:
    alphabet = "abc xyz,.!?\n éüñçø日本語中文字한국어🤖🎉👍🏽❤️‍🔥Ωπ√∑"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))


# --- byte-level BPE: SmolLM2 ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", [*TEXTS, *(_random_text(random.Random(seed)) for seed in range(20))])
def test_deltas_add_up_to_the_decode(smollm2: Tokenizer, text: str) -> None:
    prompt = smollm2.encode("<|im_start|>user\nSay it 🤖<|im_end|>\n<|im_start|>assistant\n")
    output = smollm2.encode(text, add_special_tokens=False)
    deltas, stop = _stream(IncrementalDetokenizer(smollm2, prompt), output)
    assert stop is None
    assert "".join(deltas) == smollm2.decode(output) == text
    assert not any(FFFD in delta for delta in deltas)


def test_a_character_split_across_tokens_waits_until_whole(smollm2: Tokenizer) -> None:
    robot = smollm2.encode("🤖", add_special_tokens=False)
    assert len(robot) > 1 and FFFD in smollm2.decode(robot[:1])
    detokenizer = IncrementalDetokenizer(smollm2, smollm2.encode("Hi"))
    deltas = []
    for token_id in robot:
        detokenizer.add_token(token_id)
        deltas.append(detokenizer.take_delta())
    assert deltas == [""] * (len(robot) - 1) + ["🤖"]


def test_finish_flushes_a_character_cut_short(smollm2: Tokenizer) -> None:
    first = smollm2.encode("🤖", add_special_tokens=False)[:1]
    deltas, _ = _stream(IncrementalDetokenizer(smollm2, []), first)
    assert deltas == ["", smollm2.decode(first)]
    assert FFFD in deltas[-1]


def test_a_prompt_ending_inside_a_character_does_not_leak(smollm2: Tokenizer) -> None:
    prompt = smollm2.encode("Hello 🤖", add_special_tokens=False)[:-1]
    assert smollm2.decode(prompt).endswith(FFFD)
    output = smollm2.encode(" world 🎉", add_special_tokens=False)
    deltas, _ = _stream(IncrementalDetokenizer(smollm2, prompt), output)
    assert "".join(deltas) == " world 🎉"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_are_skipped_or_kept(smollm2: Tokenizer, skip_special_tokens: bool) -> None:
    output = smollm2.encode("Hi <|im_end|> there 🎉<|im_end|>", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(smollm2, [1], skip_special_tokens=skip_special_tokens)
    deltas, _ = _stream(detokenizer, output)
    assert "".join(deltas) == smollm2.decode(output, skip_special_tokens=skip_special_tokens)


def test_decoding_reads_a_bounded_window(smollm2: Tokenizer) -> None:
    """Linear cost: every decode covers a few tokens, never the whole output so far."""
    output = smollm2.encode(" ".join(TEXTS * 8), add_special_tokens=False)
    counting = _CountingTokenizer(smollm2)
    deltas, _ = _stream(IncrementalDetokenizer(counting, smollm2.encode("Go")), output)  # type: ignore[arg-type]
    assert "".join(deltas) == smollm2.decode(output)
    assert len(output) > 300
    assert max(counting.lengths) <= 12
    assert len(counting.lengths) <= 2 * len(output) + 10


class _CountingTokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self._tokenizer.decode(ids, skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tokenizer.id_to_token(i)


# --- stop strings ---------------------------------------------------------------------------------------

STOP_TEXT = " Hello world, how are you? 日本語 is fun 🤖 ok"


@pytest.mark.parametrize(
    ("stop", "expected_stop", "cut"),
    [
        (["lo wor"], "lo wor", " Hel"),  # spans " Hello" and " world"
        (["how are"], "how are", " Hello world, "),
        (["本語"], "本語", " Hello world, how are you? 日"),  # characters split across tokens
        (["s fun 🤖"], "s fun 🤖", " Hello world, how are you? 日本語 i"),
        (["you?", "world"], "world", " Hello "),  # the earliest in the text wins, not the first listed
        (["ell", "Hel"], "Hel", " "),  # both complete in one token: the earliest start wins
        (["Hello", "Hello w"], "Hello", " "),  # same start: the one ending first
        ([" Hello"], " Hello", ""),
        (["ok"], "ok", " Hello world, how are you? 日本語 is fun 🤖 "),
    ],
)
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_are_never_emitted(
    smollm2: Tokenizer, stop: list[str], expected_stop: str, cut: str, include: bool
) -> None:
    output = smollm2.encode(STOP_TEXT, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(smollm2, [1], stop=stop, include_stop_str_in_output=include)
    deltas, found = _stream(detokenizer, output)
    assert found == expected_stop == detokenizer.stop_string
    assert "".join(deltas) == (cut + expected_stop if include else cut)
    if not include:
        assert not any(s in delta for s in stop for delta in deltas)
    with pytest.raises(ValueError, match="finished"):
        detokenizer.add_token(output[0])


def test_text_that_cannot_start_a_stop_string_is_not_held(smollm2: Tokenizer) -> None:
    output = smollm2.encode(" Hello world", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(smollm2, [1], stop=["###", "xyz"])
    streamed = ""
    for token_id in output:
        assert detokenizer.add_token(token_id) is None
        streamed += detokenizer.take_delta()
    assert streamed == " Hello world"


def test_a_possible_stop_is_held_until_it_cannot_be_one(smollm2: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(smollm2, [1], stop=[" world peace"])
    streamed = []
    for token_id in smollm2.encode(" Hello world order", add_special_tokens=False):
        detokenizer.add_token(token_id)
        streamed.append(detokenizer.take_delta())
    assert streamed == [" Hello", "", " world order"]


def test_a_stop_found_only_when_finishing_still_cuts(smollm2: Tokenizer) -> None:
    """A stop followed by a cut-short character is found once finish() releases the character."""
    robot = smollm2.encode(" 🤖", add_special_tokens=False)
    output = smollm2.encode("ab", add_special_tokens=False) + robot[:1]
    assert smollm2.decode(output).endswith(FFFD)
    detokenizer = IncrementalDetokenizer(smollm2, [1], stop=[FFFD])
    deltas, found = _stream(detokenizer, output)
    assert found is None and detokenizer.stop_string == FFFD
    assert "".join(deltas) == smollm2.decode(output).split(FFFD)[0]


def test_stop_strings_count_from_min_tokens(smollm2: Tokenizer) -> None:
    output = smollm2.encode(" Hello world, how", add_special_tokens=False)
    assert len(output) == 4
    detokenizer = IncrementalDetokenizer(smollm2, [1], stop=[" "], min_tokens=3)
    deltas, found = _stream(detokenizer, output)
    assert found == " "
    assert "".join(deltas) == " Hello world,"


def test_a_stop_wholly_before_min_tokens_never_counts(smollm2: Tokenizer) -> None:
    output = smollm2.encode(" Hello world", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(smollm2, [1], stop=["ll", "xxxxxxxx"], min_tokens=2)
    deltas, found = _stream(detokenizer, output)
    assert (found, detokenizer.stop_string) == (None, None)
    assert "".join(deltas) == " Hello world"


def test_bad_stop_strings_are_refused(smollm2: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(smollm2, [], stop=[""])
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(smollm2, [], stop="stop")


# --- the invariants, on any tokens ----------------------------------------------------------------------


def _expected(tokenizer: Tokenizer, output: list[int], stops: list[str], skip: bool, include: bool) -> Any:
    """Where a stop should end the sequence, found the slow, obvious way: (text, stop, stopping token)."""
    for count in range(1, len(output) + 1):
        whole_characters = tokenizer.decode(output[:count], skip).rstrip(FFFD)
        found = _earliest(whole_characters, stops)
        if found is not None:
            return _cut(whole_characters, *found, include), found[1], count
    text = tokenizer.decode(output, skip)
    found = _earliest(text, stops)
    return (text, None, None) if found is None else (_cut(text, *found, include), found[1], None)


def _earliest(text: str, stops: list[str]) -> tuple[int, str] | None:
    hits = sorted((text.find(s), len(s), s) for s in stops if s in text)
    return (hits[0][0], hits[0][2]) if hits else None


def _cut(text: str, start: int, stop: str, include: bool) -> str:
    return text[: start + len(stop)] if include else text[:start]


def _token_ids(vocab_size: int, encode: Any) -> st.SearchStrategy[list[int]]:
    """Any ids at all, or the ids of some text (so characters split across tokens come whole)."""
    return st.one_of(
        st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=40), st.text(min_size=1).map(encode)
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_invariants_hold_for_any_tokens(smollm2: Tokenizer, data: st.DataObject) -> None:
    encode = lambda text: smollm2.encode(text, add_special_tokens=False) or [0]  # noqa: E731
    prompt = data.draw(st.lists(st.integers(0, smollm2.vocab_size - 1), max_size=8))
    output = data.draw(_token_ids(smollm2.vocab_size, encode))
    skip = data.draw(st.booleans())
    include = data.draw(st.booleans())
    decoded = smollm2.decode(output, skip)
    stops = [
        decoded[start : start + size]
        for start, size in data.draw(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 4)), max_size=3))
        if decoded[start : start + size]
    ]
    stops += data.draw(st.lists(st.sampled_from(["\n", " the", "!!", "🤖"]), max_size=1))
    detokenizer = IncrementalDetokenizer(
        smollm2, prompt, skip_special_tokens=skip, stop=stops, include_stop_str_in_output=include
    )
    deltas, found = _stream(detokenizer, output)
    text, stop, stopping_token = _expected(smollm2, output, stops, skip, include)
    assert "".join(deltas) == detokenizer.text == text
    assert (found, detokenizer.stop_string) == (stop if stopping_token else None, stop)
    if FFFD not in text:
        assert not any(FFFD in delta for delta in deltas)
    unsafe = text[: -len(stop)] if include and stop else text
    assert not any(s in unsafe for s in stops)


# --- SentencePiece: a tiny model trained here, written to a GGUF as llama.cpp's converter does ---------

_WORDS = "the quick brown fox jumps over lazy dog river stone light bright night sight running jumped".split()
SPM_TEXTS = [
    "the quick brown fox",
    "night  sight   bright  ",
    "Zürich 日本 🤖 1234 — new words",
    "the\nnight\n\n tabs\t!",
    " jumped over",
]


@pytest.fixture(scope="module")
def sentencepiece(sentencepiece_gguf: Path) -> Tokenizer:
    path = sentencepiece_gguf
    return Tokenizer.from_dict(dataclasses.asdict(tokenizer_info_from_gguf(gguf.GGUFReader(path), str(path))))


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_spacing(sentencepiece: Tokenizer, text: str) -> None:
    prompt = sentencepiece.encode("the quick")
    output = sentencepiece.encode(text, add_special_tokens=False)
    deltas, _ = _stream(IncrementalDetokenizer(sentencepiece, prompt), output)
    full = sentencepiece.decode(prompt + output)
    assert "".join(deltas) == full[len(sentencepiece.decode(prompt)) :]
    assert not any(FFFD in delta for delta in deltas)
    # The output's own decode drops the space its first "▁" piece carries; after a prompt it is kept.
    leading = " " if sentencepiece.id_to_token(output[0]).startswith("▁") else ""
    assert "".join(deltas) == leading + sentencepiece.decode(output)


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_without_a_prompt_matches_the_decode(sentencepiece: Tokenizer, text: str) -> None:
    output = sentencepiece.encode(text, add_special_tokens=False)
    deltas, _ = _stream(IncrementalDetokenizer(sentencepiece, []), output)
    assert "".join(deltas) == sentencepiece.decode(output)


def test_sentencepiece_byte_fallback_characters_wait_until_whole(sentencepiece: Tokenizer) -> None:
    output = sentencepiece.encode("日本", add_special_tokens=False)
    assert sum(sentencepiece.id_to_token(i).startswith("<0x") for i in output) == 6
    detokenizer = IncrementalDetokenizer(sentencepiece, sentencepiece.encode("the"), stop=["本"])
    deltas, found = _stream(detokenizer, output)
    assert found == "本"
    assert "".join(deltas) == " 日"
    assert not any(FFFD in delta for delta in deltas)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_sentencepiece_invariants_hold_for_any_tokens(sentencepiece: Tokenizer, data: st.DataObject) -> None:
    encode = lambda text: sentencepiece.encode(text, add_special_tokens=False) or [5]  # noqa: E731
    words = data.draw(st.lists(st.sampled_from(_WORDS), max_size=8))
    prompt = sentencepiece.encode(" ".join(words))
    output = data.draw(_token_ids(sentencepiece.vocab_size, encode))
    skip = data.draw(st.booleans())
    deltas, _ = _stream(IncrementalDetokenizer(sentencepiece, prompt, skip_special_tokens=skip), output)
    context = prompt[-6:]  # whole words decode to whole characters, so all of the last 6 give context
    full = sentencepiece.decode(context + output, skip)
    assert "".join(deltas) == full[len(sentencepiece.decode(context, skip)) :]
    if FFFD not in full:
        assert not any(FFFD in delta for delta in deltas)
