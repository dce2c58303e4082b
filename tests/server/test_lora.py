"""LoRA adapters through `kiln serve` with the `openai` client: a tiny random-weight Llama with PEFT
adapters, one given at start (--lora-modules) and one loaded at run time; the base model and both adapters
in concurrent streams, each stream's tokens transformers + peft's greedy ones; /v1/models lists the
adapters under their base; unloading; every bad adapter a 4xx naming the problem, the server still
serving."""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import TinyLoRAModel, save_tiny_lora
from tests.server.conftest import MODEL_NAME, ServerProcess

PROMPT = [5, 17, 42, 99, 3, 7, 11]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def llama(tiny_lora_models: dict[str, TinyLoRAModel]) -> TinyLoRAModel:
    return tiny_lora_models["llama"]


@pytest.fixture(scope="module")
def server(llama: TinyLoRAModel) -> Iterator[ServerProcess]:
    # the reference backend: no compile at start, and steps slow enough that a stream of 8 x 480 tokens
    # surely still runs when the unload test asks; tests/test_lora.py checks TVM's adapters
    flags = [
        "--backend",
        "reference",
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-loras",
        "2",
        "--allow-runtime-lora-updating",
    ]
    process = ServerProcess(llama.base, *flags, "--lora-modules", f"r4={llama.adapters['r4']}")
    yield process
    process.stop()


def greedy(llama: TinyLoRAModel, adapter: str | None) -> list[int]:
    model = llama.peft_model(adapter)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS
        )
    return out[0, len(PROMPT) :].tolist()


def text_of(server: ServerProcess, token_ids: list[int]) -> str:
    """(the word-level tokenizer's text of a reply starts with a space after the prompt, not alone)"""
    return (
        server.post("/detokenize", json={"model": MODEL_NAME, "tokens": token_ids}).json()["prompt"].strip()
    )


def test_base_and_two_adapters_stream_together_each_with_its_own_tokens(
    server: ServerProcess, llama: TinyLoRAModel
) -> None:
    loaded = server.post(
        "/v1/load_lora_adapter", json={"lora_name": "r8", "lora_path": str(llama.adapters["r8"])}
    )
    assert loaded.status_code == 200, loaded.text
    models = {card.id: card for card in server.client().models.list().data}
    assert set(models) == {MODEL_NAME, "r4", "r8"}
    assert models["r4"].parent == MODEL_NAME and models["r8"].root == str(llama.adapters["r8"])

    async def stream(model: str) -> tuple[str, str]:
        client = server.async_client()
        chunks = await client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        pieces, named = [], set()
        async for chunk in chunks:
            named.add(chunk.model)
            pieces += [choice.text for choice in chunk.choices]
        assert named == {model}
        return model, "".join(pieces).strip()

    async def together() -> list[tuple[str, str]]:
        return await asyncio.gather(*(stream(model) for model in (MODEL_NAME, "r4", "r8", "r4", MODEL_NAME)))

    replies = asyncio.run(together())
    expected = {
        model: text_of(server, greedy(llama, None if model == MODEL_NAME else model))
        for model in (MODEL_NAME, "r4", "r8")
    }
    assert len(set(expected.values())) == 3
    assert replies == [(model, expected[model]) for model, _ in replies]
    samples = server.metrics()
    assert samples["kiln:lora_requests_total{lora_name=r4}"] >= 2
    assert samples["kiln:lora_requests_total{lora_name=r8}"] >= 1


def test_unloading_refused_while_a_stream_uses_the_adapter_then_done(
    server: ServerProcess, llama: TinyLoRAModel
) -> None:
    assert (
        server.post(
            "/v1/load_lora_adapter", json={"lora_name": "busy", "lora_path": str(llama.adapters["r4"])}
        ).status_code
        == 200
    )
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        timeout=60,
        json={
            "model": "busy",
            "prompt": PROMPT,
            "max_tokens": 480,
            "n": 8,
            "stream": True,
            "ignore_eos": True,
        },
    ) as response:
        lines = response.iter_lines()  # held: a generator let go closes the response (the client leaves)
        first = next(lines)  # the stream has started: its 8 sequences hold the adapter
        assert "error" not in first, first
        refused = server.post("/v1/unload_lora_adapter", json={"lora_name": "busy"})
        assert refused.status_code == 409, refused.text
        assert re.search(r"in use by \d+ running and \d+ waiting", refused.json()["error"]["message"])
    unloaded = server.post("/v1/unload_lora_adapter", json={"lora_name": "busy"})
    for _ in range(50):  # the engine sees the client leave within a step or two
        if unloaded.status_code == 200:
            break
        unloaded = server.post("/v1/unload_lora_adapter", json={"lora_name": "busy"})
    assert unloaded.status_code == 200, unloaded.text
    gone = server.post("/v1/completions", json={"model": "busy", "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
    assert server.post("/v1/unload_lora_adapter", json={"lora_name": "busy"}).status_code == 404


def _bad_adapters(llama: TinyLoRAModel, folder: Path) -> dict[str, tuple[str, str]]:
    """name -> (path, what the error must say)."""
    from safetensors.numpy import load_file, save_file

    wrong_base = folder / "wrong-base"
    shutil.copytree(llama.adapters["r4"], wrong_base)
    tensors = load_file(wrong_base / "adapter_model.safetensors")
    key = next(k for k in tensors if "layers.0.self_attn.q_proj.lora_A" in k)
    tensors[key] = tensors[key][:, :48].copy()
    save_file(tensors, wrong_base / "adapter_model.safetensors", metadata={"format": "pt"})
    corrupt = folder / "corrupt"
    shutil.copytree(llama.adapters["r4"], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    rank16 = save_tiny_lora(llama.base, folder / "rank16", 9, 16)
    return {
        "wrong-base": (str(wrong_base), "maps 48 -> 64 features, this model's 64 -> 64"),
        "rank16": (str(rank16), "rank 16, more than max_lora_rank 8"),
        "missing": (str(folder / "nowhere"), "no such adapter folder or file"),
        "corrupt": (str(corrupt), "corrupt safetensors file"),
    }


def test_bad_adapters_are_4xx_naming_the_problem_and_the_server_keeps_serving(
    server: ServerProcess, llama: TinyLoRAModel, tmp_path: Path
) -> None:
    for name, (path, said) in _bad_adapters(llama, tmp_path).items():
        response = server.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert said in error["message"], (name, error)
        assert error["type"] == "invalid_request_error"
    again = server.post(
        "/v1/load_lora_adapter", json={"lora_name": "r4", "lora_path": str(llama.adapters["r8"])}
    )
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert server.post("/v1/load_lora_adapter", json={"lora_name": "x"}).status_code == 400  # no lora_path
    reply = server.client().completions.create(
        model="r4", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].text.strip() == text_of(server, greedy(llama, "r4"))
    assert {card.id for card in server.client().models.list().data} >= {MODEL_NAME, "r4"}
