"""The OpenAI-compatible routes on the real model, through the `openai` client (sync and async)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow  # every test here needs the SmolLM2 server (~10 s to start)

FRANCE = "The capital of France is"
REPO = Path(__file__).resolve().parents[2]


def test_the_startup_line_says_what_is_served(api_server, smollm2_gguf_path: Path) -> None:
    """The target `make serve` picks here: this CPU, or the local GPU's arch where this host builds for it."""
    from kiln.compiler import ModelOptions, resolve

    (target,) = resolve(ModelOptions(str(smollm2_gguf_path))).targets
    shown = "target cpu (" if target.kind == "cpu" else f"target {target.name},"
    (line,) = [line for line in api_server.log().splitlines() if line.startswith("kiln: serving ")]
    assert f"on {api_server.url} (backend tvm, {shown}" in line and "quantization gguf" in line
    assert "max_model_len 1,024, max_num_seqs 16; KV cache 1,024 blocks of 16 tokens" in line


def test_the_serving_process_holds_neither_torch_nor_the_tvm_compiler(start_server, tmp_path: Path) -> None:
    """`make serve` loads only what serving needs: the TVM runtime, numpy and the HTTP stack; torch (~210
    MiB of RSS) and libtvm_compiler stay on disk, even at a first start, whose compile runs in a child."""
    from kiln.backends.targets import host_gpu_arch

    if host_gpu_arch() is not None:
        pytest.skip("a GPU host serves its GPU's artifact, which runs with torch (CUDA staging and graphs)")
    server = start_server(env={**os.environ, "KILN_HOME": str(tmp_path)})  # an empty cache: a first start
    assert "first start of " in server.log() and "compiling for tvm" in server.log()
    assert "write weights" in server.log()  # the child's stages reached this process's progress display
    out = server.client().completions.create(model=server.model, prompt=FRANCE, max_tokens=4, temperature=0.8)
    assert out.choices[0].text
    libraries = {line.rsplit("/", 1)[-1].strip() for line in Path(f"/proc/{server.process.pid}/maps").open()}
    assert "libtvm_runtime.so" in libraries
    assert not {name for name in libraries if name.startswith(("libtorch", "libtvm_compiler"))}, libraries


def test_models_lists_the_served_model(api_server) -> None:
    models = api_server.client().models.list()
    assert [m.id for m in models.data] == [api_server.model]
    assert models.data[0].object == "model"


def test_completion(api_server) -> None:
    out = api_server.client().completions.create(
        model=api_server.model, prompt=FRANCE, max_tokens=6, temperature=0
    )
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == api_server.model
    assert out.created > 0
    (choice,) = out.choices
    assert choice.index == 0 and choice.text.startswith(" Paris")
    assert choice.finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (5, 6, 11)


def test_completion_prompt_forms_and_echo(api_server) -> None:
    ids = api_server.post("/tokenize", json={"prompt": FRANCE}).json()["tokens"]
    client = api_server.client()
    text = client.completions.create(
        model=api_server.model, prompt=[FRANCE, "1, 2, 3,"], max_tokens=4, temperature=0
    )
    tokens = client.completions.create(model=api_server.model, prompt=[ids], max_tokens=4, temperature=0)
    one_list = client.completions.create(
        model=api_server.model, prompt=ids, max_tokens=4, temperature=0, echo=True
    )
    assert [c.index for c in text.choices] == [0, 1]
    assert text.choices[0].text == tokens.choices[0].text
    assert one_list.choices[0].text == FRANCE + text.choices[0].text
    assert text.usage is not None and text.usage.completion_tokens == 8


def test_chat(api_server) -> None:
    out = api_server.client().chat.completions.create(
        model=api_server.model,
        messages=[
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]},
        ],
        max_completion_tokens=16,
        temperature=0,
    )
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    (choice,) = out.choices
    assert choice.message.role == "assistant" and "Paris" in (choice.message.content or "")
    assert choice.finish_reason in ("stop", "length")
    assert out.usage is not None and out.usage.completion_tokens <= 16
    counted = api_server.post(
        "/tokenize",
        json={
            "messages": [
                {"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"},
            ]
        },
    ).json()
    assert counted["count"] == out.usage.prompt_tokens


def test_streamed_chat_equals_the_non_streamed_text(api_server) -> None:
    client = api_server.client()
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(
        model=api_server.model, messages=messages, max_tokens=12, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=api_server.model,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_n_samples(api_server) -> None:
    client = api_server.client()
    out = client.completions.create(
        model=api_server.model, prompt="Once upon a time", n=2, max_tokens=4, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage is not None and out.usage.completion_tokens <= 8
    chat = client.chat.completions.create(
        model=api_server.model, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=4, seed=7
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_completion_logprobs(api_server) -> None:
    client = api_server.client()
    out = client.completions.create(
        model=api_server.model, prompt=FRANCE, max_tokens=4, temperature=0, logprobs=3
    )
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert "".join(logprobs.tokens) == out.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)]
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert logprob <= 0 and len(top) in (3, 4)
        assert top[token] == logprob == max(top.values())  # greedy: the chosen token is the likeliest

    echoed = client.completions.create(
        model=api_server.model, prompt=FRANCE, max_tokens=2, temperature=0, logprobs=1, echo=True
    )
    echo_logprobs = echoed.choices[0].logprobs
    assert echo_logprobs is not None and echo_logprobs.token_logprobs and echo_logprobs.tokens
    assert len(echo_logprobs.tokens) == 5 + 2
    assert echo_logprobs.token_logprobs[0] is None
    assert "".join(echo_logprobs.tokens) == echoed.choices[0].text


def test_chat_logprobs(api_server) -> None:
    out = api_server.client().chat.completions.create(
        model=api_server.model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert out.usage is not None and len(content) == out.usage.completion_tokens
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob


def test_stop_strings(api_server) -> None:
    client = api_server.client()
    out = client.completions.create(
        model=api_server.model, prompt=FRANCE, max_tokens=8, temperature=0, stop=["."]
    )
    choice = out.choices[0]
    assert choice.text == " Paris" and choice.finish_reason == "stop"
    assert choice.model_extra is not None and choice.model_extra.get("stop_reason") == "."
    kept = client.completions.create(
        model=api_server.model,
        prompt=FRANCE,
        max_tokens=8,
        temperature=0,
        stop=".",
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == " Paris."


def test_seed_reproduces_a_sample(api_server) -> None:
    async def sample(client, seed: int) -> str:
        out = await client.completions.create(
            model=api_server.model,
            prompt="My favourite animal is",
            max_tokens=8,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return out.choices[0].text

    async def main() -> list[str]:
        async with api_server.async_client() as client:
            return await asyncio.gather(*(sample(client, seed) for seed in (1234, 1234, 4321)))

    first, again, other = asyncio.run(main())
    assert first == again
    assert first != other


def test_sixteen_concurrent_streams(api_server) -> None:
    prompts = [f"Request {i}: count from {i} upwards:" for i in range(16)]

    async def stream(client, prompt: str) -> tuple[str, int, str | None]:
        chunks = await client.completions.create(
            model=api_server.model,
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage, finish = "", 0, None
        async for chunk in chunks:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return text, usage, finish

    async def main() -> list[tuple[str, int, str | None]]:
        async with api_server.async_client() as client:
            return await asyncio.gather(*(stream(client, p) for p in prompts))

    results = asyncio.run(main())
    assert all(usage == 6 and finish == "length" for _, usage, finish in results)
    alone = api_server.client().completions.create(
        model=api_server.model,
        prompt=prompts[5],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert results[5][0] == alone.choices[0].text  # a request's output does not depend on its batch


def test_tokenize_detokenize_round_trip(api_server) -> None:
    text = "Hello, wörld! Kilns fire clay at 1200 °C."
    tokenized = api_server.post(
        "/tokenize", json={"model": api_server.model, "prompt": text, "return_token_strs": True}
    )
    assert tokenized.status_code == 200
    body = tokenized.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 5
    assert body["max_model_len"] == 1024
    detokenized = api_server.post("/detokenize", json={"model": api_server.model, "tokens": body["tokens"]})
    assert detokenized.status_code == 200 and detokenized.json() == {"prompt": text}


def test_metrics_move_with_traffic(api_server) -> None:
    before = api_server.metrics()
    for name in (
        "kiln:num_requests_running",
        "kiln:num_requests_waiting",
        "kiln:kv_cache_usage_perc",
        "kiln:time_to_first_token_seconds_count",
        "kiln:inter_token_latency_seconds_count",
        "kiln:e2e_request_latency_seconds_count",
    ):
        assert name in before, name
    out = api_server.client().completions.create(
        model=api_server.model, prompt=FRANCE, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None
    after = api_server.metrics()

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("kiln:prompt_tokens_total") == out.usage.prompt_tokens == 5
    assert moved("kiln:generation_tokens_total") == 4
    assert moved("kiln:request_success_total{finished_reason=length}") == 1
    assert moved("kiln:time_to_first_token_seconds_count") == 1
    assert moved("kiln:inter_token_latency_seconds_count") == 3
    assert moved("kiln:e2e_request_latency_seconds_count") == 1
    assert after["kiln:e2e_request_latency_seconds_sum"] > before.get(
        "kiln:e2e_request_latency_seconds_sum", 0
    )


def test_a_draft_model_speculates_behind_the_api(start_server, smollm2_gguf_path) -> None:
    """`kiln serve --speculative-config '{"model": ...}'` (SmolLM2 drafting for itself): the greedy text
    is the same streamed or not, and /metrics counts the drafts, nearly all accepted."""
    config = json.dumps({"model": str(smollm2_gguf_path), "num_speculative_tokens": 3})
    server = start_server("--max-model-len", "1024", "--speculative-config", config)
    messages = [
        {"role": "user", "content": "Repeat after me: the cat sat on the mat, the cat sat on the mat."}
    ]
    client = server.client()
    greedy: dict = {"max_tokens": 40, "temperature": 0, "extra_body": {"ignore_eos": True}}  # no cut drafts
    reply = client.chat.completions.create(model=server.model, messages=messages, **greedy)
    stream = client.chat.completions.create(model=server.model, messages=messages, stream=True, **greedy)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert reply.choices[0].message.content == streamed
    samples = server.metrics()
    drafted = samples["kiln:spec_decode_num_draft_tokens_total"]
    assert drafted > 0 and samples["kiln:spec_decode_num_accepted_tokens_total"] > 0.9 * drafted
    assert samples["kiln:spec_decode_num_accepted_tokens_per_pos_total{position=0}"] > 0


def test_a_client_leaving_mid_stream_aborts_its_request(api_server) -> None:
    before = api_server.metrics()
    body = {"model": api_server.model, "prompt": "Tell me a long story.", "max_tokens": 200, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", f"{api_server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(4), strict=False) if line.startswith("data: ")]
        assert received
        running = api_server.metrics()
        assert running["kiln:num_requests_running"] == 1 and running["kiln:kv_cache_usage_perc"] > 0
    after = api_server.wait_for_metrics(
        lambda m: m["kiln:num_requests_running"] == 0 and m["kiln:kv_cache_usage_perc"] == 0
    )
    assert after["kiln:num_requests_running"] == 0 and after["kiln:num_requests_waiting"] == 0
    assert after["kiln:kv_cache_usage_perc"] == 0
    aborted = "kiln:request_success_total{finished_reason=abort}"
    assert after.get(aborted, 0) - before.get(aborted, 0) == 1
    assert after["kiln:generation_tokens_total"] - before["kiln:generation_tokens_total"] < 100


def test_bench_serve_measures_the_server(api_server) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "serve.py"),
            "--base-url",
            api_server.url,
            "--model",
            api_server.model,
            "--concurrency",
            "2",
            "--num-requests",
            "2",
            "--input-len",
            "16",
            "--output-len",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "tok/s" in result.stdout and "ttft" in result.stdout.lower()
