"""The reasoning parsers on scripted text: whole, and streamed split at every character boundary; and
through `kiln serve --reasoning-parser` (SmolLM2 writes no `</think>`: with deepseek_r1 its whole
reply is reasoning, with qwen3 its whole reply is content); a structured output held outside the
reasoning, and the reasoning tokens counted in /v1/responses' usage, on a tiny Qwen3 with `<think>`
tokens."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import httpx
import openai
import pytest

from kiln.runtime.sampling_params import ReasoningTokens
from kiln.server.reasoning import ReasoningStream, count_reasoning_tokens, split

CASES = [
    (
        "deepseek_r1",
        "Let me think. 2 + 2 is 4.</think>The answer is 4.",
        ("Let me think. 2 + 2 is 4.", "The answer is 4."),
    ),
    ("deepseek_r1", "<think>hmm</think>\n\nYes.", ("hmm", "\n\nYes.")),
    ("deepseek_r1", "Still thinking, cut off <", ("Still thinking, cut off <", "")),
    ("qwen3", "<think>\nPlan: add.\n</think>\n\n4", ("\nPlan: add.\n", "\n\n4")),
    ("qwen3", "No thinking here: 4 < 5.", ("", "No thinking here: 4 < 5.")),
    ("qwen3", "<think>unfinished", ("unfinished", "")),
]


@pytest.mark.parametrize(("parser", "text", "expected"), CASES)
def test_whole_and_streamed(parser: str, text: str, expected: tuple[str, str]) -> None:
    assert split(parser, text, True) == expected
    for cut in range(len(text) + 1):
        stream = ReasoningStream(parser)
        first = stream.feed(text[:cut], False)
        second = stream.feed(text[cut:], True)
        assert (first[0] + second[0], first[1] + second[1]) == expected, cut
    stream = ReasoningStream(parser)
    pieces = [stream.feed(ch, i == len(text) - 1) for i, ch in enumerate(text)]
    assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == expected


@pytest.mark.slow
@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_through_the_server(start_server, parser: str) -> None:
    server = start_server("--max-model-len", "512", "--reasoning-parser", parser)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    asked = {"model": server.model, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 12}
    message = client.chat.completions.create(temperature=0.0, **asked).choices[0].message  # type: ignore[arg-type]
    reasoning = getattr(message, "reasoning_content", None)
    if parser == "deepseek_r1":
        assert reasoning and message.content is None
    else:
        assert reasoning is None and message.content
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(temperature=0.0, stream=True, **asked):  # type: ignore[arg-type]
        delta = chunk.choices[0].delta.model_dump()
        for key in streamed:
            streamed[key] += delta.get(key) or ""
    assert streamed == {"reasoning_content": reasoning or "", "content": message.content or ""}


# A Qwen3-style chat template: thinking on by default (the reply may open `<think>` itself), off with
# chat_template_kwargs {"enable_thinking": false} (the prompt closes an empty block); `opened` is the
# DeepSeek-R1 style, whose prompt opens the block.
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant "
    "{% if enable_thinking is defined and enable_thinking is false %}<think> </think>{% endif %}"
    "{% if opened is defined and opened %}<think>{% endif %}{% endif %}"
)
SPECIAL = ["<unk>", "</s>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
THINK, END_THINK = SPECIAL.index("<think>"), SPECIAL.index("</think>")
CHOICES = ["w7", "w9", "w11"]
VOCAB = 96


@pytest.fixture(scope="module")
def tiny_qwen3_engine() -> Any:
    """A tiny random Qwen3 (qk-norm) with a word-level vocabulary whose special tokens are Qwen3's."""
    import json

    import torch
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    from kiln.backends.reference import ReferenceExecutable
    from kiln.frontend.capture import capture_weights
    from kiln.frontend.config import ModelConfig
    from kiln.frontend.models import model_class
    from kiln.runtime.config import EngineConfig
    from kiln.runtime.engine import LLMEngine
    from kiln.runtime.scheduler import SchedulerConfig
    from kiln.runtime.tokenizer import Tokenizer

    config = ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=256,
        qk_norm=True,
    )
    with torch.device("meta"):
        shapes = model_class(config)(config).state_dict()
    generator = torch.Generator().manual_seed(3)
    weights = {name: torch.randn(t.shape, generator=generator) * 0.5 for name, t in shapes.items()}
    captured = capture_weights(config, weights)
    vocab = {**{token: i for i, token in enumerate(SPECIAL)}}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), VOCAB)})
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    data = json.loads(backend.to_str())
    data["added_tokens"] = [
        {
            "id": i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL)
        if i > 0
    ]
    tokenizer = Tokenizer(json.dumps(data), QWEN3_TEMPLATE, None, "<|im_end|>", False, [1, 3])
    engine_config = EngineConfig(block_size=4, num_blocks=64, scheduler=SchedulerConfig(8, 32, True))
    return LLMEngine(
        ReferenceExecutable(captured.graph, captured.weights), tokenizer, "tiny", 256, engine_config
    )


@pytest.mark.parametrize(
    ("parser", "template_kwargs", "bias", "reasoning"),
    [
        ("qwen3", {}, {}, None),  # the reply does not think: constrained from its first token
        ("qwen3", {}, {THINK: 50, END_THINK: 100}, ""),  # it opens and closes a block, then the choice
        ("qwen3", {"enable_thinking": False}, {THINK: 100}, None),  # the prompt closed it: no new block
        ("qwen3", {"opened": True}, {END_THINK: 100}, ""),  # the prompt opened it
        ("deepseek_r1", {}, {END_THINK: 100}, ""),  # the reply starts inside its reasoning
    ],
)
def test_a_structured_output_holds_outside_the_reasoning(
    start_app, tiny_qwen3_engine, parser: str, template_kwargs: dict, bias: dict, reasoning: str | None
) -> None:
    """The choice constrains the reply wherever its reasoning block starts and ends, or where it has
    none (before, a reply that never wrote `</think>` was never constrained)."""
    app = start_app(tiny_qwen3_engine, reasoning_parser=parser)
    client = openai.OpenAI(base_url=f"{app.url}/v1", api_key="none", max_retries=0)
    for seed in range(4):
        message = (
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "w20 w21 w22"}],
                max_tokens=8,
                temperature=1.0,
                seed=seed,
                logit_bias={str(token): value for token, value in bias.items()},
                extra_body={
                    "structured_outputs": {"choice": CHOICES},
                    "chat_template_kwargs": template_kwargs,
                },
            )
            .choices[0]
            .message
        )
        assert (message.content or "").strip() in CHOICES, (seed, message)  # word-level text: " w9"
        thought = getattr(message, "reasoning_content", None)
        assert (thought if thought is None else thought.strip()) == reasoning, message


# (parser, reply token ids, its reasoning text, reasoning tokens) with <think>, </think> one token each
W = len(SPECIAL)  # a word
COUNTS = [
    ("deepseek_r1", [W, W, END_THINK, W], "w w", 2),  # starts inside: up to </think>
    ("deepseek_r1", [THINK, W, END_THINK, W], "w", 1),  # a leading <think> is no reasoning
    ("deepseek_r1", [W, THINK, W], "w <think> w", 3),  # one inside it is
    ("deepseek_r1", [W, W, W], "w w w", 3),  # never closed: all of it
    ("deepseek_r1", [END_THINK, W], "", 0),
    ("qwen3", [THINK, W, W, END_THINK, W], "w w", 2),
    ("qwen3", [W, W], "", 0),  # no block
    ("qwen3", [THINK, END_THINK, W], "", 0),
]


@pytest.mark.parametrize(("parser", "ids", "reasoning", "expected"), COUNTS)
def test_counting_the_reasoning_tokens(parser: str, ids: list[int], reasoning: str, expected: int) -> None:
    markers = ReasoningTokens(THINK, END_THINK, implicit_start=parser == "deepseek_r1")
    assert count_reasoning_tokens(parser, markers, ids, reasoning, pytest.fail) == expected
    # markers spelled in several tokens: the reasoning text's own tokens
    assert count_reasoning_tokens(parser, None, ids, reasoning, str.split) == len(reasoning.split())


def _final_response(stream: httpx.Response) -> dict[str, Any]:
    *_, last = (line for line in stream.text.splitlines() if line.startswith("data: "))
    return json.loads(last.removeprefix("data: "))["response"]


@pytest.mark.parametrize(
    ("parser", "bias"), [("deepseek_r1", {END_THINK: 3.0}), ("qwen3", {THINK: 4.0, END_THINK: 3.0})]
)
def test_responses_usage_counts_the_reasoning_tokens(
    start_app, tiny_qwen3_engine, monkeypatch, parser: str, bias: dict[int, float]
) -> None:
    """/v1/responses' usage.output_tokens_details.reasoning_tokens: the reply's tokens inside its
    reasoning (not its markers nor the EOS), whole and streamed alike; on this word-level vocabulary the
    reasoning item's words. The replies are sampled with the markers' logits raised (set on the engine's
    requests: a Responses request takes no logit_bias or seed), so that they reason for all, part or none
    of their tokens."""
    seed = {"next": 0}
    add_request = tiny_qwen3_engine.add_request

    def biased(request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> None:
        params = dataclasses.replace(params, logit_bias=bias, seed=seed["next"])
        add_request(request_id, prompt, params, *args, **kwargs)

    monkeypatch.setattr(tiny_qwen3_engine, "add_request", biased)
    app = start_app(tiny_qwen3_engine, reasoning_parser=parser)
    body = {"model": "tiny", "input": "w20 w27", "max_output_tokens": 10, "temperature": 1.0}
    kinds = set()
    for seed["next"] in range(8):
        whole = httpx.post(f"{app.url}/v1/responses", json=body, timeout=30).json()
        usage = whole["usage"]
        thought = "".join(
            part["text"]
            for item in whole["output"]
            if item["type"] == "reasoning"
            for part in item["content"]
        )
        counted = usage["output_tokens_details"]["reasoning_tokens"]
        assert counted == len(thought.split()), whole
        said = any(item["type"] == "message" for item in whole["output"])
        kinds.add(("reasoned" if counted else "") + ("said" if said else ""))
        streamed = httpx.post(f"{app.url}/v1/responses", json=body | {"stream": True}, timeout=30)
        streamed_usage = _final_response(streamed)["usage"]  # (its prompt found in the prefix cache)
        assert streamed_usage["output_tokens_details"] == usage["output_tokens_details"]
    assert "reasonedsaid" in kinds and len(kinds) >= 2, kinds  # replies closing their reasoning, and others
