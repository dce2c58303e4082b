"""Tokenize, detokenize and render chat templates from an artifact's plain tokenizer fields."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

from kiln.errors import KilnError


class TokenizerError(KilnError):
    """A tokenizer or chat template cannot be loaded or used."""


class ChatTemplateError(TokenizerError):
    """A chat template refused the messages (its `raise_exception`) or failed to render."""


_FIELDS = ("tokenizer_json", "chat_template", "bos_token", "eos_token", "add_bos_token", "eos_token_ids")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat template that go with it.

    `encode` adds the bos token itself when `add_bos_token` says to, never through the backend's
    post-processor, so every source of tokenizer (GGUF or HF) behaves the same.
    """

    def __init__(
        self,
        tokenizer_json: str,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        add_bos_token: bool,
        eos_token_ids: Sequence[int],
    ) -> None:
        try:
            self._backend = _BackendTokenizer.from_str(tokenizer_json)
        except Exception as e:
            raise TokenizerError(
                f"cannot load the tokenizer: {e}",
                hint="the artifact's tokenizer is corrupt; compile it again",
            ) from e
        self.tokenizer_json = tokenizer_json
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token
        self._eos_token_ids = tuple(int(i) for i in eos_token_ids)
        if add_bos_token and self.bos_token_id is None:
            raise TokenizerError(
                f"the tokenizer adds a bos token {bos_token!r} that is not in its vocabulary",
                hint="the model's tokenizer files disagree; re-export them",
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Tokenizer:
        missing = [name for name in _FIELDS if name not in d]
        if missing:
            raise TokenizerError(
                f"tokenizer data lacks {', '.join(missing)}",
                hint="the artifact is incomplete; compile it again",
            )
        return cls(**{name: d[name] for name in _FIELDS})

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokenizer_json": self.tokenizer_json,
            "chat_template": self.chat_template,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos_token,
            "eos_token_ids": list(self._eos_token_ids),
        }

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @cached_property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._backend.token_to_id(self.bos_token)

    def id_to_token(self, i: int) -> str | None:
        return self._backend.id_to_token(i)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it), so a long text tokenized on a
        # worker thread leaves the server's event loop running.
        ids: list[int] = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The conversation as the model's template writes it, rendered as Hugging Face renders it.

        `template_kwargs` are extra variables some templates read (`enable_thinking`, `documents`).
        """
        if self.chat_template is None:
            raise ChatTemplateError(
                "the model has no chat template",
                hint="send a plain completion prompt instead of chat messages",
            )
        variables = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "documents": None,
            **template_kwargs,
        }
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return _compile(self.chat_template).render(
                messages=chat, tools=tools, add_generation_prompt=add_generation_prompt, **variables
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(
                f"the chat template failed: {e}", hint="check the messages' roles and order"
            ) from e


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message, hint="the model's chat template does not accept these messages")


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own `tojson` escapes HTML characters; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    """The template in Hugging Face's environment: sandboxed, trim_blocks, lstrip_blocks, its globals."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"the chat template does not parse: {e}", hint="the model's chat template is broken"
        ) from e
