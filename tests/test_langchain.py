"""LangChain against Thermostat, unmodified (issue 13): `ChatOpenAI(...).bind_tools(...)` with
pydantic and `@tool` tools, whole and streamed, `with_structured_output(...)` by each method
langchain-openai offers, and an agent round trip (a tool call, a ToolMessage, a second turn) on
tiny random Qwen3, Llama and Mistral models (their tokenizers' tool-call markers shaped as the
real ones) and the demo model. A tiny random model calls tools only when
the grammar forces it (`tool_choice` a name or "required"), so every test forces the call.

No network: LangSmith tracing is off, nothing counts tokens (tiktoken would download its
encodings), and a guard refuses any connection that is not to the loopback server."""

from __future__ import annotations

import json
import socket
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field, ValidationError

pytest.importorskip("langchain_openai")

from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402

from tests.server_utils import running_server  # noqa: E402
from tests.tool_models import write_tool_model  # noqa: E402

# langchain-openai's model_dump of the openai client's ParsedChatCompletion (the client's own
# types, nothing Thermostat sends): langchain-ai/langchain#35538
pytestmark = pytest.mark.filterwarnings(
    "ignore:Pydantic serializer warnings:UserWarning:pydantic.main"
)

LANGSMITH_ENV = (
    "LANGCHAIN_TRACING_V2",
    "LANGCHAIN_TRACING",
    "LANGSMITH_TRACING",
    "LANGSMITH_TRACING_V2",
    "LANGCHAIN_API_KEY",
    "LANGSMITH_API_KEY",
    "LANGCHAIN_ENDPOINT",
    "LANGSMITH_ENDPOINT",
)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No LangSmith, and no connection anywhere but 127.0.0.1."""
    for name in LANGSMITH_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LANGSMITH_TRACING", "false")
    monkeypatch.setenv("LANGCHAIN_TRACING_V2", "false")
    connect = socket.socket.connect

    def loopback_only(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            assert address[0] in ("127.0.0.1", "::1", "localhost"), f"network: {address}"
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", loopback_only)


class GetWeather(BaseModel):
    """Current weather of a city."""

    city: str = Field(max_length=12)
    unit: Literal["C", "F"]


@tool
def get_time(zone: Literal[-1, 0, 1, 2]) -> str:
    """The current time in a UTC offset."""
    return f"12:00 UTC{zone:+d}"


class Pet(BaseModel):
    name: str = Field(max_length=10)
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=30)


ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module", params=["qwen3", "llama", "mistral", "demo"])
def server(request, tmp_path_factory):
    """Real-shaped markers (tests/tool_models.py): Qwen's added, Llama's and Mistral's
    special, the demo's plain text."""
    with running_server(write_tool_model(tmp_path_factory.mktemp("m"), request.param)) as s:
        yield s


def chat(server, max_tokens: int = 400, **kwargs) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key="x",
        model=server.model,
        temperature=0,
        max_retries=0,
        timeout=60,
        max_tokens=max_tokens,
        **kwargs,
    )


def check_call(call: dict) -> None:
    """A LangChain tool call (a dict: name, args, id) whose args validate against its tool."""
    assert call["id"].startswith("call_") and call.get("type", "tool_call") == "tool_call"
    if call["name"] == "GetWeather":
        GetWeather.model_validate(call["args"])
    else:
        assert call["name"] == "get_time"
        get_time.args_schema.model_validate(call["args"])


@pytest.mark.parametrize("choice", ["GetWeather", "get_time", "required", "any"])
def test_bind_tools_invoke_and_stream(server, choice):
    llm = chat(server).bind_tools(
        [GetWeather, get_time], tool_choice=choice, parallel_tool_calls=False
    )
    message = llm.invoke(ASK)
    assert isinstance(message, AIMessage)
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert not message.invalid_tool_calls
    (call,) = message.tool_calls
    check_call(call)
    if choice not in ("required", "any"):
        assert call["name"] == choice

    chunks = list(llm.stream(ASK))
    assert len(chunks) > 2 and all(isinstance(c, AIMessageChunk) for c in chunks)
    joined = chunks[0]
    for chunk in chunks[1:]:
        joined += chunk
    assert not joined.invalid_tool_calls
    (streamed,) = joined.tool_calls
    check_call(streamed)
    assert streamed["name"] == call["name"]
    assert joined.response_metadata["finish_reason"] == "tool_calls"


def test_a_tool_schema_as_a_dict_and_strict(server):
    """An OpenAI-format tool dict and `strict=True` (LangChain then sends `strict` and
    `additionalProperties: false`)."""
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": GetWeather.model_json_schema(),
        },
    }
    llm = chat(server).bind_tools([weather], tool_choice="get_weather", strict=True)
    (call,) = llm.invoke(ASK).tool_calls
    assert call["name"] == "get_weather"
    GetWeather.model_validate(call["args"])


@pytest.mark.parametrize("method", [None, "json_schema", "function_calling"])
def test_with_structured_output(server, method):
    kwargs = {} if method is None else {"method": method}
    structured = chat(server).with_structured_output(Pet, **kwargs)
    pet = structured.invoke("Describe a pet.")
    assert isinstance(pet, Pet)
    # include_raw: the raw AIMessage beside the parsed value, and no parsing error
    out = chat(server).with_structured_output(Pet, include_raw=True, **kwargs).invoke("A pet?")
    assert out["parsing_error"] is None and isinstance(out["parsed"], Pet)
    assert isinstance(out["raw"], AIMessage)
    # streamed: the last value is the whole object
    *_, last = structured.stream("Describe a pet.")
    assert isinstance(last, Pet)


def test_with_structured_output_strict_and_json_mode(server):
    pet = chat(server).with_structured_output(Pet, method="json_schema", strict=True)
    assert isinstance(pet.invoke("Describe a pet."), Pet)
    pet = chat(server).with_structured_output(Pet, method="function_calling", strict=True)
    assert isinstance(pet.invoke("Describe a pet."), Pet)
    # json_mode: any JSON object (a random model's keys are its own), parsed to a dict
    # or, when it does not close the object within max_tokens, openai's LengthFinishReasonError
    # (the openai client's parse raises it; test_structured's json_object test allows "length")
    json_mode = chat(server, max_tokens=100).with_structured_output(method="json_mode")
    try:
        value = json_mode.invoke("JSON?")
    except openai.LengthFinishReasonError:
        return
    assert isinstance(value, dict)


def test_an_agent_round_trip(server):
    """A forced call, its result as a ToolMessage, then a second turn: the server takes the
    assistant message with `tool_calls` (and `content: null`) and the tool message back."""
    tools = {"GetWeather": GetWeather, "get_time": get_time}
    llm = chat(server).bind_tools(
        list(tools.values()), tool_choice="required", parallel_tool_calls=False
    )
    messages: list = [HumanMessage(ASK)]
    for _turn in range(2):
        message = llm.invoke(messages)
        assert message.tool_calls and not message.invalid_tool_calls
        messages.append(message)
        for call in message.tool_calls:
            check_call(call)
            if call["name"] == "get_time":
                messages.append(get_time.invoke(call))  # a ToolMessage with the call's id
            else:
                messages.append(
                    ToolMessage(f"sunny in {call['args']['city']}", tool_call_id=call["id"])
                )
        assert isinstance(messages[-1], ToolMessage)
        assert messages[-1].tool_call_id == message.tool_calls[-1]["id"]
    # the last turn: free text (tool_choice none), bounded
    final = chat(server, max_tokens=5).bind_tools(list(tools.values()), tool_choice="none")
    answer = final.invoke(messages)
    assert isinstance(answer, AIMessage) and not answer.tool_calls
    assert answer.response_metadata["finish_reason"] in ("stop", "length")
    assert isinstance(answer.content, str)
    # an auto turn returns text or calls, whichever the model picks, all parseable
    auto = chat(server, max_tokens=20).bind_tools(list(tools.values()))
    answer = auto.invoke(messages)
    assert isinstance(answer, AIMessage)
    for call in answer.tool_calls:
        check_call(call)


def test_validation_error_is_not_silent():
    """The checks above do reject: arguments outside a tool's schema fail validation."""
    with pytest.raises(ValidationError):
        GetWeather.model_validate({"city": "Paris", "unit": "K"})
    with pytest.raises(ValidationError):
        get_time.args_schema.model_validate({"zone": 7})
    assert json.loads(json.dumps(GetWeather.model_json_schema()))["required"] == ["city", "unit"]


def test_forced_calls_close_open_object_schemas():
    """The server fix LangChain needed: tools without `additionalProperties` (bind_tools'
    default) get it false in the forced-call grammar, so a model cannot add keys until its
    budget ends. Explicit choices, key-less objects and allOf members are left as they are."""
    from thermostat.sampling.structured import closed

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "b": {"type": "object", "additionalProperties": {"type": "string"}},
            "c": {"type": "array", "items": {"$ref": "#/$defs/D"}},
            "properties": {"type": "object"},
        },
        "$defs": {"D": {"properties": {"y": {"type": "string"}}, "allOf": [{"properties": {}}]}},
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["b"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in out["properties"]["properties"]  # any object
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert out["$defs"]["D"]["allOf"] == [{"properties": {}}]
    assert "additionalProperties" not in schema  # a copy
    assert closed({"type": "object"}) == {"type": "object"}
