"""/v1/embeddings: the `openai` client against the real SmolLM2 server, vectors checked against
transformers' pooled hidden states; the request's shapes and errors on the tiny model in-process."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import numpy as np
import pytest

from tests.server.conftest import MODEL_NAME, TINY_MODEL_NAME

COSINE_TOLERANCE = 1e-4


def _hf_last_hidden(model: Any, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
    return hidden.numpy().astype(np.float64)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_openai_client_embeds_like_transformers(api_server, smollm2_hf) -> None:
    client = api_server.client()
    texts = ["The capital of France is Paris.", "Kilns fire clay at high temperatures, slowly."]
    one = client.embeddings.create(model=MODEL_NAME, input=texts[0])
    many = client.embeddings.create(model=MODEL_NAME, input=texts)
    assert [d.index for d in many.data] == [0, 1]
    assert np.allclose(one.data[0].embedding, many.data[0].embedding, atol=1e-5)  # batch-invariant
    tokenizer_ids = [api_server.post("/tokenize", json={"prompt": text}).json()["tokens"] for text in texts]
    assert many.usage.prompt_tokens == sum(len(ids) for ids in tokenizer_ids)
    for data, ids in zip(many.data, tokenizer_ids, strict=True):
        vector = np.array(data.embedding)
        assert len(vector) == smollm2_hf.config.hidden_size
        assert abs(np.linalg.norm(vector) - 1) < 1e-5  # normalized by default
        reference = _hf_last_hidden(smollm2_hf, ids)[-1]  # last-token pooling: a decoder's default
        assert _cosine(vector, reference) > 1 - COSINE_TOLERANCE
    # token ids in, base64 out, no normalizing, fewer dimensions
    raw = api_server.post(
        "/v1/embeddings",
        json={
            "model": MODEL_NAME,
            "input": [tokenizer_ids[1]],
            "encoding_format": "base64",
            "normalize": False,
            "dimensions": 64,
        },
    ).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    reference = _hf_last_hidden(smollm2_hf, tokenizer_ids[1])[-1][:64]
    assert _cosine(vector, reference) > 1 - COSINE_TOLERANCE
    assert abs(np.linalg.norm(vector) / np.linalg.norm(reference) - 1) < 1e-3


def _post(url: str, body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json=body, timeout=30)


def test_shapes_on_the_tiny_model(start_app) -> None:
    server = start_app()
    body = _post(server.url, {"model": TINY_MODEL_NAME, "input": ["w3 w4 w5", "w6"]}).json()
    assert body["object"] == "list" and body["model"] == TINY_MODEL_NAME
    assert [d["object"] for d in body["data"]] == ["embedding", "embedding"]
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    single = _post(server.url, {"input": [3, 4, 5]}).json()  # token ids, no model: the served one
    assert np.allclose(single["data"][0]["embedding"], body["data"][0]["embedding"], atol=1e-6)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["w3", ""]}, "input[1]"),
        ({"input": [[3], [1000]]}, "input[1]"),
        ({"input": [-1]}, "input"),
        ({"input": "w3", "dimensions": 0}, "dimensions"),
        ({"input": "w3", "dimensions": 33}, "dimensions"),
        ({"input": "w3", "encoding_format": "hex"}, "encoding_format"),
        ({"input": 3}, "input"),
        ({"input": " ".join(["w3"] * 300)}, "input"),
        ({"input": "w3", "normalize": "yes"}, "normalize"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(start_app, body: dict[str, Any], param: str) -> None:
    server = start_app()
    response = _post(server.url, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_unknown_model_is_404(start_app) -> None:
    response = _post(start_app().url, {"model": "nope", "input": "w3"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
