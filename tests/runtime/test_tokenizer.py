"""The runtime tokenizer on a small in-test vocabulary; chat templates against transformers' renderer."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from transformers import PreTrainedTokenizerFast

from kiln.errors import KilnError
from kiln.runtime.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Exercises what Hugging Face's renderer sets up: trim_blocks/lstrip_blocks, tojson, namespace,
# loop controls, bos/eos variables, tools, and raise_exception.
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='') %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% set ns.system = message['content'] %}
        {% continue %}
    {% endif %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
[{{ message['role'] | upper }}]{% if ns.system %} ({{ ns.system }}){% endif %}
{{ message['content'] }}
    {% if message.meta is defined %}
meta={{ message.meta | tojson }} sorted={{ message.meta | tojson(indent=1, sort_keys=True) }}
    {% endif %}
{% endfor %}
{% if tools %}tools={{ tools | tojson }}{% endif %}
{% if add_generation_prompt %}[ASSISTANT]{% else %}{{ eos_token }}{% endif %}"""
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Привет <b>&</b>", "meta": {"z": "ü", "a": [1, 2.5, None]}},
        {"role": "assistant", "content": "Hello", "tool_calls": None},
        {"role": "user", "content": "Bye 👋"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    """A byte-level vocabulary of single bytes plus "ab", with ChatML special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(["<|im_start|>", "<|im_end|>", *sorted(alphabet), "ab"])}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")]
    )
    return backend.to_str()


def _tokenizer(
    tokenizer_json: str, add_bos_token: bool = True, chat_template: str | None = CHATML
) -> Tokenizer:
    return Tokenizer(tokenizer_json, chat_template, "<|im_start|>", "<|im_end|>", add_bos_token, [1])


def test_round_trips_through_json(tokenizer_json: str) -> None:
    tokenizer = _tokenizer(tokenizer_json)
    again = Tokenizer.from_dict(json.loads(json.dumps(tokenizer.to_dict())))
    assert again.to_dict() == tokenizer.to_dict()
    assert again.encode("abc ü") == tokenizer.encode("abc ü")


def test_from_dict_names_missing_fields(tokenizer_json: str) -> None:
    with pytest.raises(TokenizerError, match="eos_token_ids"):
        Tokenizer.from_dict(
            {k: v for k, v in _tokenizer(tokenizer_json).to_dict().items() if k != "eos_token_ids"}
        )


def test_corrupt_tokenizer_json() -> None:
    with pytest.raises(KilnError, match="cannot load the tokenizer"):
        Tokenizer("{}", None, None, None, False, [])


def test_encode_adds_bos_only_when_asked(tokenizer_json: str) -> None:
    with_bos, without_bos = _tokenizer(tokenizer_json), _tokenizer(tokenizer_json, add_bos_token=False)
    body = without_bos.encode("abc")
    assert [without_bos.id_to_token(i) for i in body] == ["ab", "c"]
    assert with_bos.encode("abc") == [0, *body]
    assert with_bos.encode("abc", add_special_tokens=False) == body
    assert without_bos.encode("abc", add_special_tokens=True) == body


def test_decode_skips_special_tokens(tokenizer_json: str) -> None:
    tokenizer = _tokenizer(tokenizer_json)
    ids = tokenizer.encode("<|im_start|>ab ü<|im_end|>")
    assert ids[:2] == [0, 0]
    assert tokenizer.decode(ids) == "ab ü"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|><|im_start|>ab ü<|im_end|>"


def test_vocabulary_accessors(tokenizer_json: str) -> None:
    tokenizer = _tokenizer(tokenizer_json)
    assert tokenizer.vocab_size == 2 + 256 + 1
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (0, (1,))
    assert tokenizer.id_to_token(258) == "ab"
    assert tokenizer.id_to_token(10_000) is None


def test_bos_must_be_in_vocabulary(tokenizer_json: str) -> None:
    with pytest.raises(TokenizerError, match="<bos>"):
        Tokenizer(tokenizer_json, None, "<bos>", None, True, [])


@pytest.mark.parametrize("template", [CHATML, RICH_TEMPLATE])
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(
    tokenizer_json: str, template: str, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    theirs = PreTrainedTokenizerFast(
        tokenizer_object=BackendTokenizer.from_str(tokenizer_json),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
    )
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    expected = theirs.apply_chat_template(
        messages,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        tokenize=False,
    )
    ours = _tokenizer(tokenizer_json, chat_template=template)
    assert (
        ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        == expected
    )


def test_template_raise_exception(tokenizer_json: str) -> None:
    tokenizer = _tokenizer(tokenizer_json, chat_template=RICH_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="Unknown role: robot") as raised:
        tokenizer.apply_chat_template([{"role": "robot", "content": "beep"}])
    assert isinstance(raised.value, KilnError) and raised.value.hint


def test_template_errors_are_kiln_errors(tokenizer_json: str) -> None:
    with pytest.raises(ChatTemplateError, match="does not parse"):
        _tokenizer(tokenizer_json, chat_template="{% for %}").apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="failed"):
        _tokenizer(tokenizer_json, chat_template="{{ messages[0]['content'] }}").apply_chat_template([])


def test_template_is_sandboxed(tokenizer_json: str) -> None:
    escape = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError):
        _tokenizer(tokenizer_json, chat_template=escape).apply_chat_template([])


def test_no_chat_template(tokenizer_json: str) -> None:
    with pytest.raises(ChatTemplateError, match="no chat template") as raised:
        _tokenizer(tokenizer_json, chat_template=None).apply_chat_template(
            [{"role": "user", "content": "hi"}]
        )
    assert raised.value.hint is not None
