"""GGUF tokenizers: ours must encode, decode and template exactly as transformers' GGUF tokenizer does."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import pytest
from transformers import AutoTokenizer

from kiln.errors import ModelLoadError
from kiln.frontend.gguf_tokenizer import PRE_TOKENIZERS, tokenizer_info_from_gguf
from kiln.frontend.source import TokenizerInfo
from kiln.runtime.tokenizer import Tokenizer

MIXED_TEXT = (
    "Hello, world! It's a test: don't    stop\n\n\tnow.\n"
    "Numbers: 3.14159265358979, 1234567890123456789 and 0xDEADBEEF; 1,000,000.\n"
    "日本語のテキスト、中文字符。Привет, мир! مرحبا بالعالم नमस्ते दुनिया\n"
    "Emoji: 🤖🎉 👨‍👩‍👧 ❤️\n"
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\r\n"
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>  trailing   \n"
)
EDGE_TEXTS = [
    "",
    " ",
    "   \n\n  \t",
    "<|im_start|><|im_end|>",
    "<|im_start",
    "a<|endoftext|>b",
    "12345678901234567890",
    " 42 is 6*7",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Пока 👋"},
    ],
]


def _runtime(info: TokenizerInfo) -> Tokenizer:
    return Tokenizer.from_dict(dataclasses.asdict(info))


@pytest.fixture(scope="module")
def smollm2_info(smollm2_gguf_path: Path) -> TokenizerInfo:
    return tokenizer_info_from_gguf(gguf.GGUFReader(smollm2_gguf_path), str(smollm2_gguf_path))


@pytest.fixture(scope="module")
def smollm2_ours(smollm2_info: TokenizerInfo) -> Tokenizer:
    return _runtime(smollm2_info)


@pytest.fixture(scope="module")
def smollm2_theirs(smollm2_gguf_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name)


def test_smollm2_special_tokens_and_template(smollm2_info: TokenizerInfo) -> None:
    assert smollm2_info.bos_token == "<|im_start|>"
    assert smollm2_info.eos_token == "<|im_end|>"
    assert smollm2_info.add_bos_token is False
    assert smollm2_info.eos_token_ids == (2,)
    assert smollm2_info.special_tokens == {"unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}
    assert smollm2_info.chat_template is not None and "<|im_start|>" in smollm2_info.chat_template


@pytest.mark.parametrize("text", [MIXED_TEXT, *EDGE_TEXTS])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_smollm2_encodes_like_transformers(
    smollm2_ours: Tokenizer, smollm2_theirs: Any, text: str, add_special_tokens: bool
) -> None:
    ours = smollm2_ours.encode(text, add_special_tokens=add_special_tokens)
    assert ours == smollm2_theirs.encode(text, add_special_tokens=add_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_smollm2_decodes_like_transformers(
    smollm2_ours: Tokenizer, smollm2_theirs: Any, skip_special_tokens: bool
) -> None:
    ids = smollm2_theirs.encode(MIXED_TEXT)
    expected = smollm2_theirs.decode(ids, skip_special_tokens=skip_special_tokens)
    assert smollm2_ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected
    if not skip_special_tokens:
        assert expected == MIXED_TEXT


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_like_transformers(
    smollm2_ours: Tokenizer, smollm2_theirs: Any, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    expected = smollm2_theirs.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert smollm2_ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_smollm2_special_tokens_stay_whole(smollm2_ours: Tokenizer) -> None:
    assert smollm2_ours.encode("<|im_start|>user<|im_end|><|endoftext|>") == [1, 4093, 2, 0]
    assert smollm2_ours.decode([1, 4093, 2]) == "user"


def test_smollm_pre_tokenizer_splits_digits(smollm2_ours: Tokenizer) -> None:
    ids = smollm2_ours.encode("2024")
    assert [smollm2_ours.id_to_token(i) for i in ids] == ["2", "0", "2", "4"]


# --- small byte-level vocabularies, written in the test -------------------------------------------------


def _byte_level_keys(pre: str, merges: list[str], extra: dict[str, int]) -> dict[str, Any]:
    """All 256 byte tokens, the merged tokens, then `extra` tokens of the given token types."""
    byte_tokens = [
        *"!\"#$%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqrstuvwxyz{|}~",
        *(chr(c) for c in range(ord("¡"), ord("¬") + 1)),
        *(chr(c) for c in range(ord("®"), ord("ÿ") + 1)),
        *(chr(256 + n) for n in range(68)),
    ]
    merged = ["".join(m.split(" ")) for m in merges]
    tokens = [*extra, *byte_tokens, *merged]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [*extra.values(), *[1] * (len(tokens) - len(extra))],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }


_DIGIT_MERGES = ["3 4", "1 2", "12 3", "4 5", "45 6"]
_EXTRA = {"<s>": 3, "</s>": 3, "<think>": 4}


def _tiny_byte_level(gguf_writers: Any, tmp_path: Path, pre: str) -> Tokenizer:
    path = gguf_writers.write(tmp_path / f"{pre}.gguf", _byte_level_keys(pre, _DIGIT_MERGES, _EXTRA))
    return _runtime(tokenizer_info_from_gguf(gguf.GGUFReader(path), str(path)))


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_round_trips(gguf_writers: Any, tmp_path: Path, pre: str) -> None:
    tokenizer = _tiny_byte_level(gguf_writers, tmp_path, pre)
    text = MIXED_TEXT.replace("<|", "<").replace("|>", ">")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt-2", ["12", "34", "5", "6"]),
        ("llama-bpe", ["123", "456"]),
        ("qwen2", ["1", "2", "3", "4", "5", "6"]),
        ("smollm", ["1", "2", "3", "4", "5", "6"]),
    ],
)
def test_pre_tokenizer_decides_how_digits_merge(
    gguf_writers: Any, tmp_path: Path, pre: str, pieces: list[str]
) -> None:
    tokenizer = _tiny_byte_level(gguf_writers, tmp_path, pre)
    ids = tokenizer.encode("123456", add_special_tokens=False)
    assert [tokenizer.id_to_token(i) for i in ids] == pieces


def test_control_and_user_defined_tokens(gguf_writers: Any, tmp_path: Path) -> None:
    tokenizer = _tiny_byte_level(gguf_writers, tmp_path, "gpt-2")
    ids = tokenizer.encode("<s>a<think>b</s>")
    assert [tokenizer.id_to_token(i) for i in ids] == ["<s>", "a", "<think>", "b", "</s>"]
    assert tokenizer.decode(ids) == "a<think>b"  # control tokens are skipped, user-defined ones are text


def test_eot_and_eom_tokens_end_generation(gguf_writers: Any, tmp_path: Path) -> None:
    keys = {**_byte_level_keys("gpt-2", _DIGIT_MERGES, _EXTRA), "tokenizer.ggml.eot_token_id": 2}
    keys["tokenizer.ggml.eom_token_id"] = 1
    path = gguf_writers.write(tmp_path / "eot.gguf", keys)
    assert tokenizer_info_from_gguf(gguf.GGUFReader(path), str(path)).eos_token_ids == (1, 2)


def test_unknown_pre_tokenizer_is_refused(gguf_writers: Any, tmp_path: Path) -> None:
    path = gguf_writers.write(tmp_path / "odd.gguf", _byte_level_keys("no-such-pre", [], {}))
    with pytest.raises(ModelLoadError, match="no-such-pre") as raised:
        tokenizer_info_from_gguf(gguf.GGUFReader(path), str(path))
    assert (
        raised.value.hint is not None and "smollm" in raised.value.hint and "llama-bpe" in raised.value.hint
    )


def test_missing_merges_are_refused(gguf_writers: Any, tmp_path: Path) -> None:
    path = gguf_writers.write(tmp_path / "no-merges.gguf", _byte_level_keys("gpt-2", [], {}))
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.merges"):
        tokenizer_info_from_gguf(gguf.GGUFReader(path), str(path))


def test_unknown_tokenizer_model_is_refused(gguf_writers: Any, tmp_path: Path) -> None:
    keys = {**_byte_level_keys("gpt-2", [], {}), "tokenizer.ggml.model": "bert"}
    path = gguf_writers.write(tmp_path / "bert.gguf", keys)
    with pytest.raises(ModelLoadError, match="'bert'"):
        tokenizer_info_from_gguf(gguf.GGUFReader(path), str(path))


# --- SentencePiece ("llama") vocabularies ---------------------------------------------------------------

SPM_TEXTS = [
    "the quick brown fox",
    "night  sight   bright  ",
    "Zürich 日本 🤖 1234 — new words",
    "the\nnight\n\n tabs\t!",
    "",
]
# `tokenizers`' Metaspace adds no `▁` to a text that starts with a space; SentencePiece adds one anyway.
# transformers (and so we) follow `tokenizers`, so these differ from SentencePiece itself.
SPM_LEADING_SPACE_TEXTS = ["  leading spaces", " "]


@pytest.fixture(scope="module")
def spm_ours(sentencepiece_gguf: Path) -> Tokenizer:
    return _runtime(tokenizer_info_from_gguf(gguf.GGUFReader(sentencepiece_gguf), str(sentencepiece_gguf)))


@pytest.fixture(scope="module")
def spm_theirs(sentencepiece_gguf: Path) -> Any:
    return AutoTokenizer.from_pretrained(sentencepiece_gguf.parent, gguf_file=sentencepiece_gguf.name)


def test_sentencepiece_special_tokens(spm_ours: Tokenizer) -> None:
    assert (spm_ours.bos_token, spm_ours.eos_token) == ("<s>", "</s>")
    assert spm_ours.add_bos_token is True  # llama.cpp's default for a SentencePiece vocabulary
    assert spm_ours.eos_token_ids == (2,)
    assert spm_ours.vocab_size == 400


@pytest.mark.parametrize("text", [*SPM_TEXTS, *SPM_LEADING_SPACE_TEXTS, "night<s>sight</s> x <unk> y"])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_sentencepiece_encodes_like_transformers(
    spm_ours: Tokenizer, spm_theirs: Any, text: str, add_special_tokens: bool
) -> None:
    ours = spm_ours.encode(text, add_special_tokens=add_special_tokens)
    assert ours == spm_theirs.encode(text, add_special_tokens=add_special_tokens)
    for skip in (True, False):
        assert spm_ours.decode(ours, skip_special_tokens=skip) == spm_theirs.decode(
            ours, skip_special_tokens=skip
        )


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_encodes_like_sentencepiece(
    spm_ours: Tokenizer, sentencepiece_model: Any, text: str
) -> None:
    expected = sentencepiece_model.encode(text)
    assert spm_ours.encode(text, add_special_tokens=False) == expected
    assert spm_ours.decode(expected) == sentencepiece_model.decode(expected)


def test_sentencepiece_without_space_prefix(
    gguf_writers: Any, tmp_path: Path, sentencepiece_model: Any
) -> None:
    keys = {**gguf_writers.sentencepiece_vocab(sentencepiece_model), "tokenizer.ggml.add_space_prefix": False}
    path = gguf_writers.write(tmp_path / "no-prefix.gguf", keys)
    tokenizer = _runtime(tokenizer_info_from_gguf(gguf.GGUFReader(path), str(path)))
    ids = tokenizer.encode("night sight", add_special_tokens=False)
    assert not tokenizer.id_to_token(ids[0]).startswith("▁")
    assert tokenizer.decode(ids) == "night sight"
