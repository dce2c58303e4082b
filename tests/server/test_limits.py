"""--api-key (401) and --max-waiting (503), on one server with one batch slot and no waiting room."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow  # starts its own SmolLM2 server (~10 s)

KEY = "sk-kiln-test"


@pytest.fixture(scope="module")
def limited_server(start_server):
    server = start_server("--max-num-seqs", "1", "--max-waiting", "0", "--max-model-len", "512", api_key=KEY)
    yield server
    server.stop()


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_a_missing_or_wrong_key_is_401(limited_server) -> None:
    url = limited_server.url
    body = {"model": limited_server.model, "prompt": "Hi", "max_tokens": 1}
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
        {"Authorization": "Basic x"},
    ):
        error = _error(httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=10), 401)
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    for path in ("/v1/models", "/tokenize", "/v1/nothing"):
        assert httpx.get(f"{url}{path}", timeout=10).status_code == 401
    # the key is checked before the body is read
    bad_json = httpx.post(f"{url}/v1/completions", content=b"{", headers={"Content-Type": "application/json"})
    assert bad_json.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


def test_the_right_key_is_served_and_health_and_metrics_are_open(limited_server) -> None:
    assert [m.id for m in limited_server.client().models.list().data] == [limited_server.model]
    assert httpx.get(f"{limited_server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{limited_server.url}/metrics", timeout=10).status_code == 200


def test_more_waiting_than_max_waiting_is_503(limited_server) -> None:
    body = {
        "model": limited_server.model,
        "prompt": "Tell me a story.",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    url = f"{limited_server.url}/v1/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as first:
        # Once the first request has its response headers it holds the only batch slot, so a second one
        # would wait, and --max-waiting 0 lets none wait.
        assert first.status_code == 200
        second = {"model": limited_server.model, "prompt": "Hi", "max_tokens": 1}
        error = _error(httpx.post(url, json=second, headers=headers, timeout=30), 503)
        assert error["type"] == "overloaded_error" and "--max-waiting" in error["message"]
        with pytest.raises(openai.InternalServerError) as caught:
            limited_server.client().chat.completions.create(
                model=limited_server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
            )
        assert caught.value.status_code == 503
        next(first.iter_lines())
    # leaving the first stream frees the slot
    limited_server.wait_for_metrics(lambda m: m["kiln:num_requests_running"] == 0)
    out = limited_server.client().completions.create(model=limited_server.model, prompt="Hi", max_tokens=1)
    assert len(out.choices) == 1
