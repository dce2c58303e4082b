"""Request and response bodies, in OpenAI's shape (and vLLM's for its extras and /tokenize).

Request models are strict: a field of the wrong JSON type is a 400, never coerced ("10" is not an
integer, 1.5 is not one either, true is not a number). Unknown fields are ignored, as vLLM ignores them.
Fields follow the order of OpenAI's API reference; vLLM's extras (top_k, min_p, …) come last, marked.
Each request model turns itself into the engine's SamplingParams; ranges are checked there, once.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from kiln.runtime.sampling_params import SamplingParams, StructuredOutput

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- errors ---------------------------------------------------------------------------------------------


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


# -- shared pieces --------------------------------------------------------------------------------------


class StreamOptions(RequestModel):
    include_usage: bool = False


class UsageInfo(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(RequestModel):
    """vLLM's `structured_outputs`: one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingExtras(RequestModel):
    """Sampling fields both endpoints share: OpenAI's, then vLLM's extras."""

    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # under --scheduling-policy priority, smaller is served first
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names for structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The one constraint asked for, from whichever field holds it; ValueError for two or more."""
        found = self.structured_output_fields()
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise ValueError(f"give at most one structured output constraint, got {len(found)}: {names}")
        return found[0][1] if found else None

    def structured_output_fields(self) -> list[tuple[str, StructuredOutput]]:
        """(the field, its constraint) for each structured output constraint the request gives."""
        found: list[tuple[str, StructuredOutput]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", StructuredOutput("json_object")))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ValueError("response_format json_schema needs json_schema.schema")
            found.append(("response_format", StructuredOutput.json_schema(fmt.json_schema.json_schema)))
        so = self.structured_outputs
        if so is not None:
            given = {
                "json": so.json_,
                "regex": so.regex,
                "choice": so.choice,
                "grammar": so.grammar,
                "json_object": so.json_object or None,
            }
            for kind, spec in given.items():
                if spec is None:
                    continue
                if kind == "json":
                    constraint = StructuredOutput.json_schema(spec)  # type: ignore[arg-type]
                elif kind == "choice":
                    constraint = StructuredOutput.choice(spec)  # type: ignore[arg-type]
                elif kind == "json_object":
                    constraint = StructuredOutput("json_object")
                else:
                    constraint = StructuredOutput(kind, spec)  # type: ignore[arg-type]
                found.append((f"structured_outputs.{kind}", constraint))
        if self.guided_json is not None:
            found.append(("guided_json", StructuredOutput.json_schema(self.guided_json)))
        if self.guided_regex is not None:
            found.append(("guided_regex", StructuredOutput("regex", self.guided_regex)))
        if self.guided_choice is not None:
            found.append(("guided_choice", StructuredOutput.choice(self.guided_choice)))
        if self.guided_grammar is not None:
            found.append(("guided_grammar", StructuredOutput("grammar", self.guided_grammar)))
        return found

    def logit_bias_ids(self) -> dict[int, float] | None:
        """logit_bias with its JSON string keys read as token ids; ValueError names a bad key."""
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise ValueError(f"logit_bias must be keyed by token ids, got key {key!r}") from None
        return bias

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias_ids(),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_output=self.structured_output(),
        )


# -- /v1/models -----------------------------------------------------------------------------------------


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kiln"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    input_modalities: list[str] = Field(default_factory=lambda: ["text"])  # "image" for a vision model
    weight_version: int | None = None  # the served weights' version (the base model's card)
    weight_source: str | None = None  # where they came from: artifact, disk:<path>, distributed


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- LoRA adapters (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter) -----------------------------


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UpdateWeightsFromDiskRequest(RequestModel):
    """SGLang's body."""

    model_path: str = Field(min_length=1)


class WeightTransferInit(RequestModel):
    master_address: str = Field(min_length=1)
    master_port: int
    rank_offset: int = 1  # this server's rank (the trainer is rank 0)
    world_size: int = 2
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = Field(default=120.0, gt=0)


class InitWeightTransferRequest(RequestModel):
    """vLLM's body: {"init_info": {...}}."""

    init_info: WeightTransferInit


class WeightUpdateInfo(RequestModel):
    names: list[str] = Field(min_length=1)
    dtype_names: list[Literal["float32", "float16", "bfloat16"]]
    shapes: list[list[int]]


class UpdateWeightsRequest(RequestModel):
    """vLLM's body: {"update_info": {"names", "dtype_names", "shapes"}}; the trainer then broadcasts the
    tensors in that order."""

    update_info: WeightUpdateInfo


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's body has it; the name decides


# -- /v1/completions ------------------------------------------------------------------------------------


class CompletionRequest(SamplingExtras):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]

    def to_sampling_params(self) -> SamplingParams:
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)


class CompletionLogProbs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's extra: the stop string or token id that ended it


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# -- /v1/chat/completions -------------------------------------------------------------------------------


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ImageURL(RequestModel):
    url: str  # data:image/...;base64,..., file://... or http(s)://...
    detail: Literal["auto", "low", "high"] | None = None


class ImageContentPart(RequestModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextContentPart | ImageContentPart, Field(discriminator="type")]


class FunctionCallParam(RequestModel):
    name: str
    arguments: str  # JSON text


class ToolCallParam(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(RequestModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant
    tool_call_id: str | None = None  # tool

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, content: Any, info: ValidationInfo) -> Any:
        if content is None and info.data.get("role") != "assistant":
            raise ValueError("content is required (only an assistant message may leave it out)")
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if isinstance(part, TextContentPart))

    def image_parts(self) -> list[tuple[int, ImageContentPart]]:
        """(index in content, part) of each image part."""
        if not isinstance(self.content, list):
            return []
        return [(i, part) for i, part in enumerate(self.content) if isinstance(part, ImageContentPart)]


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingExtras):
    messages: list[ChatMessageParam]
    model: str | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: each logprob's token as "token_id:<id>"
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # template variables (Qwen3's enable_thinking)

    @property
    def max_tokens_param(self) -> str:
        """The field that set the output limit, to name in errors."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs must be used with logprobs set to true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        try:
            return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)
        except ValueError as error:
            if str(error).startswith("logprobs "):  # chat names the count top_logprobs
                raise ValueError(f"top_{error}") from None
            if str(error).startswith("max_tokens ") and self.max_completion_tokens is not None:
                raise ValueError(f"max_completion_tokens{str(error).removeprefix('max_tokens')}") from None
            raise


class FunctionCall(ResponseModel):
    name: str
    arguments: str


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # with --reasoning-parser; `reasoning` is vLLM's newer name
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class _DropUnset(ResponseModel):
    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(_DropUnset):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropUnset):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_DropUnset):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(ResponseModel):
    content: list[ChatCompletionTokenLogprob] | None = None


class ChatCompletionResponseChoice(ResponseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class ChatCompletionStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# -- /tokenize, /detokenize (vLLM) ----------------------------------------------------------------------


class TokenizeRequest(RequestModel):
    """vLLM's two forms in one: `prompt` (add_special_tokens defaults to true) or `messages`, rendered
    with the chat template (add_special_tokens defaults to false: the template writes them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str
