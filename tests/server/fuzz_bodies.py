"""Request bodies for the fuzz suite (test_fuzz.py): per POST endpoint a few valid seed bodies, and a
seeded generator of bodies mutated from them (fields dropped, set to values of every JSON type, wrapped
and unwrapped, unknown fields added, extreme sampling values), plus invalid JSON text, JSON that is no
object, empty bodies and the seeds themselves. The seeds the tiny server serves are `valid` cases: they
must succeed; and per endpoint at least `min_success` of all its cases do (many mutations stay valid).

Generation stays cheap: a body that would still be valid never asks for more than 4 output tokens
(max_tokens-like fields are either 1..4 or invalid: non-integers, <= 0 or past the context) nor more than
2 samples (n, best_of); a LoRA path never names anything that exists."""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TINY_VOCAB = 96  # tests/conftest.py's tiny model
MAX_OUTPUT_TOKENS = 4
MAX_SAMPLES = 2
MISSING_ADAPTER = "/nonexistent/kiln-fuzz-adapter"


@dataclass(frozen=True)
class Endpoint:
    path: str
    seeds: tuple[dict[str, Any], ...]
    anthropic: bool = False  # errors in Anthropic's shape
    streams: bool = False  # takes `stream: true`
    # fields that bound the output (null: up to the context, but on Anthropic's route, where it is a 400)
    limits: tuple[str, ...] = ()
    # the share of its cases answered 2xx, at least (about 2/3 of what the seeded bodies get: 0.22-0.34)
    min_success: float = 0.0
    # seeds (by index) that are valid but that the tiny server refuses (an image for its text-only model)
    refused_seeds: tuple[int, ...] = ()


@dataclass(frozen=True)
class Case:
    endpoint: Endpoint
    content: bytes
    content_type: str
    stream: bool  # asked for a stream (it is one only if the request is valid)
    kind: str  # how it was made: seed, mutated, invalid-json, non-object, empty, content-type
    valid: bool = False  # a seed as it is (streamed or not) that the tiny server serves: must succeed


# -- seeds ----------------------------------------------------------------------------------------------

_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
_CHAT_TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": _SCHEMA}}
_CHAT_HISTORY = [
    {"role": "system", "content": "w2"},
    {"role": "user", "content": [{"type": "text", "text": "w3 w4"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    },
    {"role": "tool", "content": "w5", "tool_call_id": "c1", "name": "f"},
]
_USER = [{"role": "user", "content": "w2 w3"}]
_ANTHROPIC_HISTORY = [
    {"role": "user", "content": [{"type": "text", "text": "w3"}]},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "w4", "signature": "s"},
            {"type": "redacted_thinking", "data": "x"},
            {"type": "text", "text": "w5"},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "w6"}]},
            {"type": "text", "text": "w7"},
        ],
    },
]
_ANTHROPIC_TOOL = {"name": "f", "description": "d", "input_schema": _SCHEMA}
_IMAGE_SOURCE = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
_IMAGE_BLOCK = {"type": "image", "source": _IMAGE_SOURCE}

COMPLETIONS = Endpoint(
    "/v1/completions",
    (
        {"model": "tiny", "prompt": "w2 w3 w4", "max_tokens": 3},
        {
            "prompt": [2, 3, 4],
            "max_tokens": 2,
            "n": 2,
            "best_of": 2,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 5,
            "min_p": 0.05,
            "seed": 1,
            "logprobs": 2,
            "echo": True,
            "stop": ["w5"],
            "stop_token_ids": [7],
            "logit_bias": {"5": 1.5},
            "user": "u",
        },
        {
            "prompt": [[2, 3], [4, 5]],
            "max_tokens": 2,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.1,
            "min_tokens": 1,
            "ignore_eos": True,
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "priority": 0,
        },
        {"prompt": ["w2", "w3 w4"], "max_tokens": 2, "structured_outputs": {"choice": ["w2", "w3 w4"]}},
        {"prompt": "w2", "max_tokens": 4, "guided_regex": "(w[2-9] ?)+"},
        {"prompt": "w2", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
    ),
    streams=True,
    limits=("max_tokens",),
    min_success=0.2,
)
CHAT = Endpoint(
    "/v1/chat/completions",
    (
        {"model": "tiny", "messages": _USER, "max_tokens": 3},
        {
            "messages": _CHAT_HISTORY,
            "max_completion_tokens": 2,
            "n": 2,
            "logprobs": True,
            "top_logprobs": 2,
            "tools": [_CHAT_TOOL],
            "tool_choice": "none",
            "temperature": 1.5,
            "top_p": 0.5,
            "seed": 7,
            "return_tokens_as_token_ids": True,
        },
        {"messages": _USER, "tools": [_CHAT_TOOL], "tool_choice": "required", "max_tokens": 4},
        {
            "messages": _USER,
            "tools": [_CHAT_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "parallel_tool_calls": False,
            "max_tokens": 4,
        },
        {
            "messages": _USER,
            "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _SCHEMA}},
        },
        {
            "messages": _USER,
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "add_generation_prompt": False,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    ),
    streams=True,
    limits=("max_tokens", "max_completion_tokens"),
    min_success=0.15,
)
EMBEDDINGS = Endpoint(
    "/v1/embeddings",
    (
        {"model": "tiny", "input": "w2 w3"},
        {"input": ["w2", "w3 w4"], "encoding_format": "base64", "dimensions": 8, "normalize": False},
        {"input": [[2, 3], [4]], "add_special_tokens": False, "user": "u"},
        {"input": [2, 3, 4], "encoding_format": "float"},
    ),
    min_success=0.2,
)
RESPONSES = Endpoint(
    "/v1/responses",
    (
        {"model": "tiny", "input": "w2 w3", "max_output_tokens": 3},
        {
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "w2"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "w3"},
                {"role": "developer", "content": "w4"},
                {"type": "reasoning", "summary": []},
            ],
            "instructions": "w5",
            "max_output_tokens": 2,
            "temperature": 0.5,
            "top_p": 0.9,
            "tools": [{"type": "function", "name": "f", "parameters": _SCHEMA}],
            "tool_choice": "none",
            "store": False,
            "metadata": {"k": "v"},
            "user": "u",
            "reasoning": {"effort": "low"},
        },
        {
            "input": [{"role": "user", "content": "w2"}],
            "max_output_tokens": 4,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": _SCHEMA}},
        },
        {
            "input": "w2",
            "max_output_tokens": 4,
            "tools": [{"type": "function", "name": "f", "parameters": _SCHEMA}],
            "tool_choice": {"type": "function", "name": "f"},
        },
        {"input": "w2", "max_output_tokens": 2, "stream": True, "parallel_tool_calls": True},
    ),
    streams=True,
    limits=("max_output_tokens",),
    min_success=0.2,
)
MESSAGES = Endpoint(
    "/v1/messages",
    (
        {"model": "tiny", "max_tokens": 3, "messages": _USER},
        {
            "max_tokens": 2,
            "system": [{"type": "text", "text": "w2"}],
            "messages": _ANTHROPIC_HISTORY,
            "tools": [_ANTHROPIC_TOOL],
            "tool_choice": {"type": "none"},
            "stop_sequences": ["w9"],
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 3,
            "metadata": {"user_id": "u"},
            "thinking": {"type": "enabled", "budget_tokens": 16},
        },
        {
            "max_tokens": 4,
            "system": "w2",
            "messages": _USER,
            "tools": [_ANTHROPIC_TOOL],
            "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
        },
        {"max_tokens": 4, "messages": [{"role": "user", "content": [_IMAGE_BLOCK]}]},
        {"max_tokens": 2, "messages": _USER, "stream": True},
    ),
    anthropic=True,
    streams=True,
    limits=("max_tokens",),
    min_success=0.15,
    refused_seeds=(3,),  # the image: the tiny model takes text only
)
COUNT_TOKENS = Endpoint(
    "/v1/messages/count_tokens",
    (
        {"model": "tiny", "messages": _USER},
        {
            "system": "w2",
            "messages": _ANTHROPIC_HISTORY,
            "tools": [_ANTHROPIC_TOOL],
            "tool_choice": {"type": "any"},
            "thinking": {"type": "adaptive"},
        },
    ),
    anthropic=True,
    min_success=0.2,
)
TOKENIZE = Endpoint(
    "/tokenize",
    (
        {"model": "tiny", "prompt": "w2 w3", "add_special_tokens": True, "return_token_strs": True},
        {"messages": _CHAT_HISTORY, "add_generation_prompt": False, "chat_template_kwargs": {"x": 1}},
    ),
    min_success=0.2,
)
DETOKENIZE = Endpoint(
    "/detokenize", ({"model": "tiny", "tokens": [2, 3, 4]}, {"tokens": []}), min_success=0.2
)
# the tiny server serves no LoRA adapters (and the adapter named exists nowhere): every one is refused
LOAD_LORA = Endpoint(
    "/v1/load_lora_adapter", ({"lora_name": "fuzz", "lora_path": MISSING_ADAPTER},), refused_seeds=(0,)
)
UNLOAD_LORA = Endpoint(
    "/v1/unload_lora_adapter",
    ({"lora_name": "fuzz", "lora_int_id": 1}, {"lora_name": "x"}),
    refused_seeds=(0, 1),
)

ENDPOINTS = (
    COMPLETIONS,
    CHAT,
    EMBEDDINGS,
    RESPONSES,
    MESSAGES,
    COUNT_TOKENS,
    TOKENIZE,
    DETOKENIZE,
    LOAD_LORA,
    UNLOAD_LORA,
)

# -- values ---------------------------------------------------------------------------------------------

INTS = (
    0, 1, -1, 2, 3, 4, 5, 17, 95, 96, 255, 256, 257, 2**31 - 1, 2**31, 2**53 + 1,
    2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**30, -(10**30), 10**400,
)  # fmt: skip
FLOATS = (
    0.0, -0.0, 0.5, 1.0, -1.0, 2.0, 1e-308, 5e-324, 1e308, -1e308, 1.7976931348623157e308, 1e20,
    -1e20, 0.1, 1e-9, float("nan"), float("inf"), float("-inf"),
)  # fmt: skip
STRINGS = (
    "", " ", "a", "w2", "w2 w3", "tiny", "null", "1", "true", "{}", "[]", "é中😀", "\x00", "\ud800",
    "\u202e\ufeff", "<|im_start|>", "</s>", "{{ messages }}", "{% raw %}", "%s%n", "\\", '"', "\n\r\t",
    "function", "text", "user", "assistant", "system", "tool", "auto", "none", "required", "json_object",
    "base64", "float", "message", "image", "tool_use", "data:image/png;base64,AAAA",
    "http://127.0.0.1:1/x.png", "file:///nonexistent.png", "resp_0", "x" * 10_000, "w5 " * 300,
)  # fmt: skip
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "n", "best_of", "seed", "logprobs", "top_logprobs",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "priority", "dimensions",
    "max_tokens", "max_completion_tokens", "max_output_tokens", "lora_int_id",
)  # fmt: skip
# body text that is not valid JSON, or nests past what a parser recurses through
INVALID_JSON = (
    b"{",
    b"}",
    b"{'a': 1}",
    b'{"a": 1,}',
    b'{"a" 1}',
    b"nul",
    b"[1, 2",
    b'{"prompt": "\xff\xfe"}',
    b"\xff\xfe\x00\x00",
    b'{"a": 01}',
    b'{"a": 1e999999}',
    b'{"a": "\\ud800\\udc00\\ud800"}',
    b'{"a": "\\x41"}',
    b"\x00",
    b"[" * 5000 + b"]" * 5000,
    b'{"a":' * 3000 + b"1" + b"}" * 3000,
)
NON_OBJECTS = ([], [{}], "{}", 1, 0.5, None, True, "", [1, 2, 3])


def _fragments() -> list[Any]:
    """Every object and list inside any seed: valid pieces for the wrong place (an Anthropic block in a
    chat message, a tool where a message goes)."""
    found = []
    for endpoint in ENDPOINTS:
        for seed in endpoint.seeds:
            found += [_get(seed, path) for path in _paths(seed)]
    return [value for value in found if isinstance(value, dict | list)]


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value of any type, or a piece of a seed; containers hold a few values, nested at most 3
    deep."""
    kind = rng.choice(("null", "bool", "int", "float", "string", "string", "list", "object", "fragment"))
    if kind == "fragment":
        return copy.deepcopy(rng.choice(FRAGMENTS))
    if depth >= 3 and kind in ("list", "object"):
        kind = "string"
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice(INTS)
    if kind == "float":
        return rng.choice(FLOATS)
    if kind == "string":
        return rng.choice(STRINGS)
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(STRINGS[:40]): random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def token_ids(rng: random.Random) -> list[int]:
    """Token ids, most in the tiny vocabulary, some outside it."""
    pick = (-1, TINY_VOCAB, TINY_VOCAB + 1, 2**31, -(2**63))
    length = rng.randint(0, 6)
    return [rng.choice(pick) if rng.random() < 0.1 else rng.randrange(TINY_VOCAB) for _ in range(length)]


def number(rng: random.Random) -> Any:
    """A value for a sampling field: mostly an extreme number, sometimes a number of the wrong kind."""
    roll = rng.random()
    if roll < 0.45:
        return rng.choice(INTS)
    if roll < 0.9:
        return rng.choice(FLOATS)
    return rng.choice((True, False, None, "1", "0.5", [1], {"value": 1}))


# -- mutation -------------------------------------------------------------------------------------------


def _paths(value: Any, path: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Every place in `value` below its root, the shallower first."""
    found = []
    if isinstance(value, dict):
        items: list[tuple[str | int, Any]] = list(value.items())
    elif isinstance(value, list):
        items = list(enumerate(value))
    else:
        return []
    for key, child in items:
        found.append((*path, key))
        found += _paths(child, (*path, key))
    return found


def _get(body: Any, path: tuple[str | int, ...]) -> Any:
    for key in path:
        body = body[key]
    return body


FRAGMENTS = _fragments()


def _mutate_at(rng: random.Random, body: dict[str, Any], path: tuple[str | int, ...]) -> None:
    parent, key = _get(body, path[:-1]), path[-1]
    value = parent[key]
    operation = rng.choice(
        ("drop", "value", "value", "number", "tokens", "wrap", "wrap", "unwrap", "stringify", "extend")
    )
    if operation == "drop":
        del parent[key]
        return
    if operation == "number":
        new = number(rng)
    elif operation == "tokens":
        new = token_ids(rng) if rng.random() < 0.7 else [token_ids(rng) for _ in range(rng.randint(0, 3))]
    elif operation == "wrap":
        new = [value] if rng.random() < 0.5 else {rng.choice(("value", "type", "text", str(key))): value}
    elif operation == "unwrap" and isinstance(value, list | dict) and value:
        new = rng.choice(list(value.values()) if isinstance(value, dict) else value)
    elif operation == "stringify":
        new = json.dumps(value)
    elif operation == "extend" and isinstance(value, list):
        new = [*value, *(rng.choice((value[0] if value else None, random_value(rng))) for _ in range(2))]
    elif operation == "extend" and isinstance(value, dict):
        new = value | {rng.choice(("type", "role", "content", "text", "x", "")): random_value(rng)}
    else:
        new = random_value(rng)
    parent[key] = new


def mutate(rng: random.Random, endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any]:
    """`body` (a deep copy of a seed) changed in 1 to 4 places."""
    for _ in range(min(4, 1 + int(rng.expovariate(1.2)))):
        roll = rng.random()
        if roll < 0.2:
            body[rng.choice(SAMPLING_FIELDS)] = number(rng)
        elif roll < 0.27:
            body[rng.choice(("unknown", "extra_field", "cache_control", "", "é"))] = random_value(rng)
        else:
            paths = _paths(body)
            if paths:
                _mutate_at(rng, body, rng.choice(paths))
    return body


def _bounded(rng: random.Random, endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any]:
    """The body, asking for at most MAX_OUTPUT_TOKENS tokens and MAX_SAMPLES samples where it is valid;
    a LoRA path naming nothing."""
    for field in endpoint.limits:
        value = body.get(field, 0)
        unbounded = value is None and not endpoint.anthropic
        if unbounded or (_int(value) and MAX_OUTPUT_TOKENS < value <= 256):
            body[field] = rng.randint(1, MAX_OUTPUT_TOKENS)
    # left out, the limit is the context (16 tokens for completions); Anthropic's is required
    unlimited = not any(body.get(field) is not None for field in endpoint.limits)
    if endpoint.limits and not endpoint.anthropic and unlimited:
        body[endpoint.limits[0]] = rng.randint(1, MAX_OUTPUT_TOKENS)
    for field in ("n", "best_of"):
        value = body.get(field)
        if _int(value) and MAX_SAMPLES < value <= 128:
            body[field] = rng.randint(1, MAX_SAMPLES)
    path = body.get("lora_path")
    if isinstance(path, str) and path != MISSING_ADAPTER and _exists(path):
        body["lora_path"] = MISSING_ADAPTER
    return body


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _exists(path: str) -> bool:
    try:
        return Path(path).exists()
    except (OSError, ValueError):  # a NUL or an unencodable surrogate in the path
        return False


def _encode(rng: random.Random, body: Any) -> bytes:
    text = json.dumps(body, ensure_ascii=rng.random() < 0.5)
    return text.encode("utf-8", errors="surrogatepass")  # a lone surrogate goes as invalid UTF-8


def generate(seed: int, count: int) -> list[Case]:
    """`count` cases over every endpoint in turn, the same ones for the same seed."""
    rng = random.Random(seed)
    cases = []
    for index in range(count):
        endpoint = ENDPOINTS[index % len(ENDPOINTS)]
        cases.append(_case(rng, endpoint))
    return cases


def _case(rng: random.Random, endpoint: Endpoint) -> Case:
    roll = rng.random()
    if roll < 0.03:
        return Case(endpoint, rng.choice(INVALID_JSON), "application/json", False, "invalid-json")
    if roll < 0.05:
        return Case(endpoint, _encode(rng, rng.choice(NON_OBJECTS)), "application/json", False, "non-object")
    if roll < 0.06:
        return Case(endpoint, b"", rng.choice(("application/json", "")), False, "empty")
    seed = rng.choice(endpoint.seeds)
    valid = endpoint.seeds.index(seed) not in endpoint.refused_seeds
    body = json.loads(json.dumps(seed))
    kind = "seed"
    if roll >= 0.12:
        body, kind = mutate(rng, endpoint, body), "mutated"
    if 0.06 <= roll < 0.07:
        content_type = rng.choice(("text/plain", "application/x-www-form-urlencoded", ""))
        content = _encode(rng, _bounded(rng, endpoint, body))
        return Case(endpoint, content, content_type, False, "content-type")
    stream = endpoint.streams and rng.random() < 0.3
    if stream:
        body["stream"] = True
    body = _bounded(rng, endpoint, body)
    stream = bool(body.get("stream") is True)
    return Case(endpoint, _encode(rng, body), "application/json", stream, kind, valid and kind == "seed")
