"""Rebuild a model's tokenizer from GGUF metadata as a `tokenizers.Tokenizer`.

A GGUF carries no `tokenizer.json`: it stores the vocabulary, merges, token types and special ids under
llama.cpp's `tokenizer.*` keys. Two vocabulary kinds are supported:

- `gpt2`: byte-level BPE, split first by the regexes that `tokenizer.ggml.pre` names (llama.cpp's
  `llama-vocab.cpp` table);
- `llama`: SentencePiece-style BPE with byte fallback and the `▁` space marker, built the way
  transformers' GGUF converter builds it, so that both encode identically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from kiln.errors import ModelLoadError
from kiln.frontend.source import TokenizerInfo

# llama.cpp's token types (`tokenizer.ggml.token_type`).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4


@dataclass(frozen=True)
class _PreTokenizer:
    regexes: tuple[str, ...]  # applied one after the other, each splitting the pieces of the last
    ignore_merges: bool = False  # a word that is already a token is not run through the merges
    add_bos: bool = False  # llama.cpp's default when the file has no `add_bos_token`


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_DEFAULT = _PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_LLAMA3_PRE = _PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_GPT2_PRE = _PreTokenizer((_GPT2,))
_SMOLLM_PRE = _PreTokenizer((r"\p{N}", _GPT2))
_QWEN2_PRE = _PreTokenizer((_QWEN2,))

# `tokenizer.ggml.pre` → how llama.cpp splits text before BPE (the common entries of its table).
PRE_TOKENIZERS: Mapping[str, _PreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        _LLAMA3_PRE,
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), _PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "roberta-bpe"), _GPT2_PRE),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), _SMOLLM_PRE
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"), _QWEN2_PRE),
    "falcon": _PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    "tekken": _PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(("gpt-4o", "llama4"), _PreTokenizer((_GPT4O,))),
}


def tokenizer_info_from_gguf(reader: gguf.GGUFReader, where: str) -> TokenizerInfo:
    """The tokenizer a GGUF file describes; `where` names the file in error messages."""
    model = _string(reader, "tokenizer.ggml.model", where)
    tokens = _array(reader, "tokenizer.ggml.tokens", where)
    token_types = _per_token(reader, "tokenizer.ggml.token_type", len(tokens), 1, where)
    if model == "gpt2":
        pre_name = _optional(reader, "tokenizer.ggml.pre") or "default"
        pre = _pre_tokenizer(pre_name, where)
        tokenizer = _byte_level_bpe(tokens, _array(reader, "tokenizer.ggml.merges", where), pre)
        default_add_bos = pre.add_bos
    elif model == "llama":
        scores = _per_token(reader, "tokenizer.ggml.scores", len(tokens), 0.0, where)
        add_prefix = _optional(reader, "tokenizer.ggml.add_space_prefix")
        merges = _optional(reader, "tokenizer.ggml.merges")
        tokenizer = _sentencepiece_bpe(tokens, scores, merges, add_prefix is not False)
        default_add_bos = True
    else:
        raise ModelLoadError(
            f"{where}: unsupported tokenizer model {model!r} in tokenizer.ggml.model",
            hint="Kiln reads GGUF tokenizers of model 'gpt2' (byte-level BPE) and 'llama' (SentencePiece)",
        )

    ids = {key: _optional(reader, f"tokenizer.ggml.{key}_token_id") for key in _SPECIAL_ID_KEYS}
    _check_ids(ids, len(tokens), where)
    _add_special_tokens(tokenizer, tokens, token_types, ids, byte_level=model == "gpt2")

    add_bos = _optional(reader, "tokenizer.ggml.add_bos_token")
    return TokenizerInfo(
        tokenizer_json=tokenizer.to_str(),
        chat_template=_optional(reader, "tokenizer.chat_template"),
        bos_token=_token(tokens, ids["bos"]),
        eos_token=_token(tokens, ids["eos"]),
        add_bos_token=default_add_bos if add_bos is None else bool(add_bos),
        eos_token_ids=tuple(dict.fromkeys(i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None)),
        special_tokens={
            f"{name}_token": tokens[i]
            for name, i in (("unk", ids["unknown"]), ("pad", ids["padding"]))
            if i is not None
        },
    )


_SPECIAL_ID_KEYS = ("bos", "eos", "eot", "eom", "unknown", "padding")


def _pre_tokenizer(name: str, where: str) -> _PreTokenizer:
    if name not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{where}: unknown pre-tokenizer {name!r} (tokenizer.ggml.pre)",
            hint=f"supported pre-tokenizers: {', '.join(sorted(PRE_TOKENIZERS))}",
        )
    return PRE_TOKENIZERS[name]


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (the `Ġ` for a space)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    chars = [chr(b) for b in printable] + [chr(256 + n) for n in range(len(others))]
    return dict(zip(printable + others, chars, strict=True))


def _byte_spelling(token: str) -> str:
    """The token as byte-level BPE spells it; a file may store a token in plain text instead."""
    alphabet = _byte_alphabet()
    if set(token) <= set(alphabet.values()):
        return token
    return "".join(alphabet[b] for b in token.encode("utf-8"))


def _byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], pre: _PreTokenizer) -> Tokenizer:
    vocab = {_byte_spelling(token): i for i, token in enumerate(tokens)}
    pairs = [_merge_pair(merge) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in pre.regexes]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _merge_pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _sentencepiece_bpe(
    tokens: Sequence[str], scores: Sequence[float], merges: Sequence[str] | None, add_prefix: bool
) -> Tokenizer:
    """SentencePiece BPE as transformers' `LlamaTokenizer` builds it from a GGUF vocabulary."""
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [_merge_pair(m) for m in merges] if merges else _merges_from_scores(vocab, tokens, scores)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_from_scores(
    vocab: Mapping[str, int], tokens: Sequence[str], scores: Sequence[float]
) -> list[tuple[str, str]]:
    """Every split of a token into two tokens is a merge, ranked by the merged token's score.

    The same order as transformers' `generate_merges`: best score first, then the longer left and right
    pieces, then the order of the vocabulary.
    """
    candidates: list[tuple[str, str, float]] = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        local = [
            (token[:cut], token[cut:], score)
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        candidates.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    candidates.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _add_special_tokens(
    tokenizer: Tokenizer,
    tokens: Sequence[str],
    token_types: Sequence[int],
    ids: Mapping[str, int | None],
    byte_level: bool,
) -> None:
    """Match control and user-defined tokens whole in text, as llama.cpp does.

    Control and unknown tokens, and the tokens the file names as bos/eos/unk/pad, become special
    (skipped when decoding with `skip_special_tokens`); user-defined ones (`<think>`) plain added tokens.
    In a byte-level vocabulary a control token spelled outside the byte alphabet is a mislabel, as
    transformers judges it, and is left out.
    """
    alphabet = set(_byte_alphabet().values())
    named = {i for key, i in ids.items() if i is not None and key != "eot" and key != "eom"}
    special = [
        AddedToken(token, special=True, normalized=False)
        for i, (token, kind) in enumerate(zip(tokens, token_types, strict=True))
        if (kind in (_UNKNOWN, _CONTROL) or i in named) and not (byte_level and not set(token) <= alphabet)
    ]
    tokenizer.add_special_tokens(special)
    vocab = tokenizer.get_vocab()
    user_defined = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == _USER_DEFINED and token in vocab
    ]
    tokenizer.add_tokens(user_defined)


def _check_ids(ids: Mapping[str, int | None], vocab_size: int, where: str) -> None:
    for key, i in ids.items():
        if i is not None and not 0 <= i < vocab_size:
            raise ModelLoadError(
                f"{where}: tokenizer.ggml.{key}_token_id is {i}, outside the {vocab_size}-token vocabulary",
                hint="the file is corrupt or was written by a broken converter; re-convert the model",
            )


def _token(tokens: Sequence[str], i: int | None) -> str | None:
    return None if i is None else tokens[i]


def _optional(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _per_token(reader: gguf.GGUFReader, key: str, n_tokens: int, default: Any, where: str) -> list[Any]:
    """A per-token array (scores, types), or `default` for every token where the file has none."""
    value = _optional(reader, key)
    if value is None:
        return [default] * n_tokens
    if not isinstance(value, list) or len(value) != n_tokens:
        raise ModelLoadError(
            f"{where}: {key} does not have one entry for each of the {n_tokens} tokens",
            hint="the file is corrupt or was written by a broken converter; re-convert the model",
        )
    return value


def _string(reader: gguf.GGUFReader, key: str, where: str) -> str:
    value = _optional(reader, key)
    if not isinstance(value, str):
        raise ModelLoadError(
            f"{where}: GGUF metadata has no string {key}",
            hint="the file carries no tokenizer; use a GGUF converted with its tokenizer or an HF directory",
        )
    return value


def _array(reader: gguf.GGUFReader, key: str, where: str) -> list[Any]:
    value = _optional(reader, key)
    if not isinstance(value, list):
        raise ModelLoadError(
            f"{where}: GGUF metadata has no {key}",
            hint="the tokenizer is incomplete; re-convert the model with llama.cpp's convert_hf_to_gguf.py",
        )
    return value
