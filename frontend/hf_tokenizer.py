"""Read a Hugging Face model directory's tokenizer files into a `TokenizerInfo`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from kiln.errors import ModelLoadError
from kiln.frontend.source import TokenizerInfo

_OTHER_SPECIAL_TOKENS = ("unk_token", "pad_token")


def tokenizer_info_from_hf_dir(path: Path) -> TokenizerInfo:
    """The tokenizer of an HF model directory: `tokenizer.json` plus its config files."""
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(
            f"{path}: no tokenizer.json",
            hint="Kiln needs the fast-tokenizer file; save one with "
            "transformers' AutoTokenizer.from_pretrained(...).save_pretrained(dir)",
        )
    tokenizer_json = tokenizer_file.read_text(encoding="utf-8")
    try:
        tokenizer = Tokenizer.from_str(tokenizer_json)
    except Exception as e:
        raise ModelLoadError(
            f"{tokenizer_file}: cannot be read as a tokenizer: {e}",
            hint="the file is corrupt or from a newer `tokenizers`; download it again",
        ) from e

    config = _read_json(path / "tokenizer_config.json")
    bos_token = _token_content(config.get("bos_token"))
    eos_token = _token_content(config.get("eos_token"))
    return TokenizerInfo(
        tokenizer_json=tokenizer_json,
        chat_template=_chat_template(path, config),
        bos_token=bos_token,
        eos_token=eos_token,
        add_bos_token=_adds_bos(tokenizer, bos_token, config),
        eos_token_ids=_eos_token_ids(path, tokenizer, eos_token),
        special_tokens={
            name: token
            for name in _OTHER_SPECIAL_TOKENS
            if (token := _token_content(config.get(name))) is not None
        },
    )


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelLoadError(
            f"{file}: not valid JSON: {e}", hint="the file is corrupt; download it again"
        ) from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file}: expected a JSON object", hint="the file is corrupt; download it again")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """`chat_template.jinja` if present (it wins, as in transformers), else the config's entry."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # the older form: named templates, one of them "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _adds_bos(tokenizer: Tokenizer, bos_token: str | None, config: dict[str, Any]) -> bool:
    """Whether transformers puts bos in front of an encoded text.

    When `tokenizer.json` has a post-processor, that decides (transformers then ignores the config's
    `add_bos_token`); without one, the config's `add_bos_token` does.
    """
    if bos_token is None:
        return False
    if tokenizer.post_processor is None:
        return bool(config.get("add_bos_token", False))
    ids = tokenizer.encode("", add_special_tokens=True).ids
    return bool(ids) and ids[0] == tokenizer.token_to_id(bos_token)


def _eos_token_ids(path: Path, tokenizer: Tokenizer, eos_token: str | None) -> tuple[int, ...]:
    """The ids that end generation: generation_config.json's (or config.json's), then the eos token's."""
    declared = _read_json(path / "generation_config.json").get("eos_token_id")
    if declared is None:
        declared = _read_json(path / "config.json").get("eos_token_id")
    ids = [declared] if isinstance(declared, int) else list(declared or [])
    eos_id = None if eos_token is None else tokenizer.token_to_id(eos_token)
    if eos_id is not None:
        ids.append(eos_id)
    return tuple(dict.fromkeys(int(i) for i in ids))
