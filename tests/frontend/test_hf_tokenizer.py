"""HF tokenizer directories: ours must encode, decode and template as transformers does from the same dir."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors
from transformers import AutoTokenizer

from kiln.errors import ModelLoadError
from kiln.frontend.hf_tokenizer import tokenizer_info_from_hf_dir
from kiln.frontend.source import TokenizerInfo
from kiln.runtime.tokenizer import Tokenizer

TEXT = (
    "Hello, world! don't    stop\n\n\tnow. 3.14159265358979 and 1234567890123456789\n"
    "日本語のテキスト Привет, мир! مرحبا नमस्ते 🤖🎉 👨‍👩‍👧\n"
    "def f(x):\n    return {'a': [1, 2]}\r\n<|im_start|>user\nhi<|im_end|>\n<|endoftext|>  \n"
)
MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi!"}],
]


def _runtime(info: TokenizerInfo) -> Tokenizer:
    return Tokenizer.from_dict(dataclasses.asdict(info))


@pytest.fixture(scope="module")
def smollm2_hf_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf_path: Path) -> Path:
    """SmolLM2's tokenizer as transformers saves it (tokenizer.json, its config, chat_template.jinja)."""
    directory = tmp_path_factory.mktemp("smollm2-hf")
    saved = AutoTokenizer.from_pretrained(smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name)
    saved.save_pretrained(directory)
    return directory


@pytest.fixture
def hf_dir(tmp_path: Path, smollm2_hf_dir: Path) -> Path:
    """A copy a test may edit."""
    return Path(shutil.copytree(smollm2_hf_dir, tmp_path / "model"))


def test_reads_saved_directory(smollm2_hf_dir: Path) -> None:
    info = tokenizer_info_from_hf_dir(smollm2_hf_dir)
    assert (info.bos_token, info.eos_token, info.add_bos_token) == ("<|im_start|>", "<|im_end|>", False)
    assert info.eos_token_ids == (2,)
    assert info.chat_template == (smollm2_hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
    assert info.special_tokens == {"unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}


def test_matches_transformers(smollm2_hf_dir: Path) -> None:
    ours = _runtime(tokenizer_info_from_hf_dir(smollm2_hf_dir))
    theirs = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    ids = theirs.encode(TEXT)
    assert ours.encode(TEXT) == ids
    assert ours.encode(TEXT, add_special_tokens=False) == theirs.encode(TEXT, add_special_tokens=False)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    for messages in MESSAGES:
        for prompt in (True, False):
            expected = theirs.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == expected


def test_bos_from_post_processor_matches_transformers(hf_dir: Path) -> None:
    backend = BackendTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(hf_dir / "tokenizer.json"))
    info = tokenizer_info_from_hf_dir(hf_dir)
    assert info.add_bos_token is True
    ours, theirs = _runtime(info), AutoTokenizer.from_pretrained(hf_dir)
    assert ours.encode(TEXT) == theirs.encode(TEXT)
    assert ours.encode(TEXT)[:2] == [1, 19556]  # one bos, not two
    assert ours.encode(TEXT, add_special_tokens=False) == theirs.encode(TEXT, add_special_tokens=False)


def _edit_json(file: Path, **changes: Any) -> None:
    data = json.loads(file.read_text(encoding="utf-8")) if file.exists() else {}
    file.write_text(json.dumps({**data, **changes}), encoding="utf-8")


def test_eos_ids_from_generation_config(hf_dir: Path) -> None:
    _edit_json(hf_dir / "generation_config.json", eos_token_id=[0, 2])
    _edit_json(hf_dir / "config.json", eos_token_id=5)
    assert tokenizer_info_from_hf_dir(hf_dir).eos_token_ids == (0, 2)


def test_eos_id_from_config_json(hf_dir: Path) -> None:
    _edit_json(hf_dir / "config.json", eos_token_id=0)
    assert tokenizer_info_from_hf_dir(hf_dir).eos_token_ids == (0, 2)


def test_special_tokens_written_as_dicts(hf_dir: Path) -> None:
    added = {"content": "<|endoftext|>", "lstrip": False, "normalized": False, "special": True}
    _edit_json(
        hf_dir / "tokenizer_config.json", bos_token=added, eos_token={**added, "content": "<|im_end|>"}
    )
    info = tokenizer_info_from_hf_dir(hf_dir)
    assert (info.bos_token, info.eos_token) == ("<|endoftext|>", "<|im_end|>")


def test_chat_template_in_tokenizer_config(hf_dir: Path) -> None:
    (hf_dir / "chat_template.jinja").unlink()
    _edit_json(hf_dir / "tokenizer_config.json", chat_template="{{ messages[0]['content'] }}")
    assert tokenizer_info_from_hf_dir(hf_dir).chat_template == "{{ messages[0]['content'] }}"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    _edit_json(hf_dir / "tokenizer_config.json", chat_template=named)
    assert tokenizer_info_from_hf_dir(hf_dir).chat_template == "D"


def test_no_chat_template(hf_dir: Path) -> None:
    (hf_dir / "chat_template.jinja").unlink()
    assert tokenizer_info_from_hf_dir(hf_dir).chat_template is None


def test_missing_tokenizer_json(hf_dir: Path) -> None:
    (hf_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json") as raised:
        tokenizer_info_from_hf_dir(hf_dir)
    assert raised.value.hint is not None and "save_pretrained" in raised.value.hint


def test_corrupt_tokenizer_json(hf_dir: Path) -> None:
    (hf_dir / "tokenizer.json").write_text('{"model": 1}', encoding="utf-8")
    with pytest.raises(ModelLoadError, match="cannot be read"):
        tokenizer_info_from_hf_dir(hf_dir)
