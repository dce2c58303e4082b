"""The pieces that need no model: request models into SamplingParams, error mapping, admission."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from kiln.server.errors import APIError, from_validation_error, from_value_error, validation_param
from kiln.server.protocol import ChatCompletionRequest, CompletionRequest, DeltaMessage
from kiln.server.serving_engine import Admission


def test_completion_request_to_sampling_params() -> None:
    request = CompletionRequest.model_validate(
        {
            "prompt": [[1, 2], [3]],
            "max_tokens": 7,
            "temperature": 0,
            "stop": "\n",
            "logit_bias": {"5": -100},
            "logprobs": 2,
            "echo": True,
            "top_k": -1,
            "ignore_eos": True,
        }
    )
    params = request.to_sampling_params()
    assert request.prompts() == [[1, 2], [3]]
    assert params.max_tokens == 7 and params.temperature == 0 and params.stop == ["\n"]
    assert params.logit_bias == {5: -100} and params.top_k is None and params.ignore_eos
    assert params.logprobs == 2 and params.prompt_logprobs == 2  # echo with logprobs: the prompt's too
    assert CompletionRequest.model_validate({"prompt": [4, 5]}).prompts() == [[4, 5]]
    assert CompletionRequest.model_validate({"prompt": "x"}).to_sampling_params().max_tokens == 16


def test_chat_request_to_sampling_params() -> None:
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ],
            "max_tokens": 3,
            "max_completion_tokens": 5,
            "logprobs": True,
            "top_logprobs": 4,
        }
    )
    params = request.to_sampling_params()
    assert params.max_tokens == 5 and params.logprobs == 4
    assert request.messages[0].text() == "a\nb"
    no_limit = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert no_limit.to_sampling_params().max_tokens is None and no_limit.to_sampling_params().logprobs is None
    with pytest.raises(ValueError, match=r"^max_completion_tokens must be >= 1"):
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}
        ).to_sampling_params()


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "max_tokens": "5"},
        {"prompt": "x", "max_tokens": 5.0},
        {"prompt": "x", "temperature": True},
        {"prompt": "x", "temperature": float("nan")},
        {"prompt": "x", "echo": 1},
        {"prompt": ["x", 1]},
    ],
)
def test_requests_are_strict(body: dict) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)


def test_validation_params_name_the_field() -> None:
    assert validation_param(("body", "temperature")) == "temperature"
    assert validation_param(("body", "messages", 0, "role")) == "messages[0].role"
    assert validation_param(("body", "messages", 1, "content", "str")) == "messages[1].content"
    assert validation_param(("body", "prompt", "list[int]", 1)) == "prompt"
    assert validation_param(("body", "messages", 0, "content", "list[TextContentPart]", 0, "type")) == (
        "messages[0].content"
    )
    assert validation_param(("body",)) is None
    assert validation_param(("body", 3)) is None


def test_validation_errors_become_one_400() -> None:
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({"prompt": 5, "n": "2"})
    errors = [{**e, "loc": ("body", *e["loc"])} for e in caught.value.errors()]
    api_error = from_validation_error(RequestValidationError(errors))
    assert api_error.status == 400 and api_error.param == "n"  # the first field in error
    assert (
        "prompt: Input matches none of the accepted types" in api_error.message and "n:" in api_error.message
    )
    body = api_error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"


def test_value_errors_name_their_field() -> None:
    assert from_value_error(ValueError("temperature must be >= 0, got -1")).param == "temperature"
    assert from_value_error(ValueError("Something else")).param is None


def test_delta_messages_leave_out_unset_fields() -> None:
    assert DeltaMessage(role="assistant", content="").model_dump() == {"role": "assistant", "content": ""}
    assert DeltaMessage(content="x").model_dump() == {"content": "x"}
    assert DeltaMessage().model_dump() == {}


def test_admission_counts_sequences_past_the_batch() -> None:
    admission = Admission(max_num_seqs=2, max_waiting=1)
    first = admission.admit(2)  # fills the batch
    second = admission.admit(1)  # waits: 1 waiting is allowed
    with pytest.raises(APIError, match="max-waiting") as caught:
        admission.admit(1)
    assert caught.value.status == 503 and caught.value.type == "overloaded_error"
    second.release()
    second.release()  # releasing twice releases once
    third = admission.admit(1)
    first.release()
    third.release()
    assert admission.num_in_flight == 0
    unlimited = Admission(max_num_seqs=1, max_waiting=None)
    holds = [unlimited.admit(4) for _ in range(10)]
    assert unlimited.num_in_flight == 40 and len(holds) == 10
