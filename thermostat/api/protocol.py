"""OpenAI wire schemas (requests and responses), with Thermostat's extension fields.

Requests are strict: a wrong JSON type is a 400, never a silent coercion ("0.5" is not a number,
2.0 is not an integer, 1 is not a boolean). Every sampling field is Optional and None by
default, so an omitted field is never confused with one sent with its default value; JSON `null`
means "not sent" too. Unknown fields are ignored, as other OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from thermostat.sampling.fields import FIELDS


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _omit_none(**kwargs: Any) -> Any:
    """A field left out of the JSON while None (extension and optional fields)."""
    return Field(default=None, exclude_if=lambda v: v is None, **kwargs)


# ---- requests ----


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage on every chunk (with include_usage)


class ContentPart(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    """One message; extra keys (name, tool_calls, ...) are passed to the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[ContentPart] | None = None


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`: OpenAI's structured outputs (`strict` is always so)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (its newer spelling of the guided_* fields)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# Fields both generation endpoints accept: the table's body fields, each `T | None = None`.
# vLLM/SGLang extras (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
# skip_special_tokens) are plain body fields, sent by the openai client through `extra_body`.
if TYPE_CHECKING:  # the type checker cannot see fields made at run time: it reads them as Any

    class _GenerationRequest(_Strict):
        def __getattr__(self, name: str) -> Any: ...

else:
    _GenerationRequest = create_model(
        "_GenerationRequest",
        __base__=_Strict,
        __module__=__name__,
        model=(str | None, None),
        **{f.name: (f.annotation | None, Field(None, description=f.doc)) for f in FIELDS if f.body},
        stream=(bool | None, None),
        stream_options=(StreamOptions | None, None),
        user=(str | None, None),
        # structured output (server/request_params.py: structured_output); at most one of them
        response_format=(ResponseFormat | None, None),
        guided_json=(dict[str, Any] | str | None, None),
        guided_regex=(str | None, None),
        guided_choice=(list[str] | None, None),
        guided_grammar=(str | None, None),
        structured_outputs=(StructuredOutputs | None, None),
        # vLLM's: end a generation whose tokens repeat (sampling/repetition_detection.py)
        repetition_detection=(dict[str, Any] | None, None),
        # SGLang's router adds these for prefill/decode disaggregation (lists: one per choice)
        bootstrap_host=(str | list[str] | None, None),
        bootstrap_port=(int | list[int] | None, None),
        bootstrap_room=(int | list[int] | None, None),
    )


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None = any object
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name; an alias of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # tool calling (server/tools.py)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None  # legacy shape: the number of top alternatives per token


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None  # with messages: the template sees them (vLLM's)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# ---- responses ----


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served by the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str  # call_...
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = _omit_none()


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None
    quality: dict[str, Any] = Field(default_factory=dict)
    sampling: dict[str, Any] | None = _omit_none()  # where it differs from the response's


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    sampling: dict[str, Any]
    quality: dict[str, Any]


class DeltaFunctionCall(BaseModel):
    name: str | None = _omit_none()
    arguments: str | None = _omit_none()  # the next piece of the JSON text


class DeltaToolCall(BaseModel):
    index: int  # of the call in the message
    id: str | None = _omit_none()  # on a call's first delta, with its type and name
    type: Literal["function"] | None = _omit_none()
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: str | None = _omit_none()
    content: str | None = _omit_none()
    tool_calls: list[DeltaToolCall] | None = _omit_none()


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = _omit_none()
    quality: dict[str, Any] | None = _omit_none()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = _omit_none()
    sampling: dict[str, Any] | None = _omit_none()  # on a chunk that carries a finish_reason
    quality: dict[str, Any] | None = _omit_none()


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = _omit_none()
    quality: dict[str, Any] | None = _omit_none()
    sampling: dict[str, Any] | None = _omit_none()  # where it differs from the response's


class CompletionResponse(BaseModel):
    """Also the streaming chunk (OpenAI uses the same object for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = _omit_none()
    sampling: dict[str, Any] | None = _omit_none()
    quality: dict[str, Any] | None = _omit_none()


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
