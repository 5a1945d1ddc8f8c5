"""The coding agents' APIs on `serve`, through the official SDKs: OpenAI's Responses API
(`client.responses`) and Anthropic's Messages API (`anthropic.Anthropic().messages`), on the demo
model and on a tiny random Qwen3 whose tokenizer holds `<tool_call>` as an added token. A text
turn, a forced tool call, a tool round trip and a JSON-schema answer, whole and streamed (the
streamed result equal to the whole one, greedy); stored responses; the billing line of Claude
Code's system prompt kept out of the prefix cache's way; bad input in each API's error shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.server_utils import running_server
from tests.tool_models import write_tool_model

WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
RESPONSES_TOOLS = [{"type": "function", **WEATHER}]
MESSAGES_TOOLS = [
    {
        "name": WEATHER["name"],
        "description": WEATHER["description"],
        "input_schema": {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            **WEATHER["parameters"],
        },
    }
]
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def demo():
    with running_server("demo") as s:
        yield s


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = write_tool_model(tmp_path_factory.mktemp("qwen"), "qwen3")
    with running_server(path) as s:
        yield s


def claude(server, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=server.url, api_key="unused", max_retries=0, timeout=60, **kwargs
    )


def streamed_response(client, **kwargs):
    """The Response the SDK's accumulator ends with (response.completed or .incomplete)."""
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete"), last.type
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return last.response, [e.type for e in events]


def _output(response) -> list[tuple]:
    """A response's output without its ids (call ids are fresh per answer)."""
    out = []
    for item in response.output:
        if item.type == "message":
            out.append(("message", item.status, [p.text for p in item.content]))
        elif item.type == "function_call":
            out.append(("function_call", item.name, item.arguments))
        else:
            out.append((item.type, item.name, item.input))
    return out


# ---- Responses ----


def test_a_responses_text_turn_whole_and_streamed(demo):
    client = demo.client()
    ask = dict(model=demo.model, input="To be or not", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**ask)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text and whole.usage.output_tokens == 12
    assert whole.sampling["effective"]["temperature"] == 0.0
    assert whole.sampling["source"]["temperature"] == "request"
    assert whole.sampling["source"]["top_p"] == "generation_config"  # omitted stays omitted
    assert whole.quality["degenerate"] is False
    streamed, kinds = streamed_response(client, **ask)
    assert _output(streamed) == _output(whole)
    assert streamed.usage == whole.usage
    assert streamed.sampling == whole.sampling and streamed.quality == whole.quality
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]


def test_instructions_and_developer_messages_are_the_system_prompt(demo):
    client = demo.client()
    items = [
        {
            "type": "message",
            "id": "msg_1",
            "role": "developer",
            "content": [{"type": "input_text", "text": "You are terse."}],
        },
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
    ]
    by_items = client.responses.input_tokens.count(model=demo.model, input=items)
    by_instructions = client.responses.input_tokens.count(
        model=demo.model, instructions="You are terse.", input="Hi"
    )
    assert by_items.input_tokens == by_instructions.input_tokens > 0


def test_stored_responses_continue_a_conversation_and_can_be_deleted(demo):
    client = demo.client()
    first = client.responses.create(model=demo.model, input="Hi", max_output_tokens=4)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    again = dict(model=demo.model, input="And then?", previous_response_id=first.id)
    counted = client.responses.input_tokens.count(**again).input_tokens
    alone = client.responses.input_tokens.count(model=demo.model, input="And then?").input_tokens
    assert counted > alone + first.usage.output_tokens - 1  # the first turn is in the prompt
    second = client.responses.create(**again, max_output_tokens=4)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == counted
    client.responses.delete(first.id)
    with pytest.raises(Exception) as err:
        client.responses.retrieve(first.id)
    assert err.value.status_code == 404 and first.id in str(err.value)
    unstored = client.responses.create(
        model=demo.model, input="Hi", max_output_tokens=2, store=False
    )
    r = httpx.get(f"{demo.url}/v1/responses/{unstored.id}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


def test_the_store_keeps_the_newest(tmp_path):
    with running_server("demo", responses_store_size=2) as s:
        client = s.client()
        ids = [
            client.responses.create(model=s.model, input="Hi", max_output_tokens=1).id
            for _ in range(3)
        ]
        assert httpx.get(f"{s.url}/v1/responses/{ids[0]}").status_code == 404
        assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


def forced_weather_call(server, max_output_tokens: int) -> dict:
    """A Responses request whose answer must call get_weather (greedy)."""
    return dict(
        model=server.model,
        input="What is the weather in Paris?",
        tools=RESPONSES_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=max_output_tokens,
    )


def test_a_forced_function_call_whole_and_streamed_then_a_round_trip(qwen):
    client = qwen.client()
    ask = forced_weather_call(qwen, max_output_tokens=120)
    whole = client.responses.create(**ask)
    assert whole.status == "completed"
    (call,) = [item for item in whole.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city", "unit"}
    assert whole.sampling["constraint"]["kind"] == "tool_call"
    streamed, kinds = streamed_response(client, **ask)
    assert _output(streamed) == _output(whole)
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    # the call's result back, as Codex sends it: the call item echoed, then its output
    history = [
        {"type": "message", "role": "user", "content": "What is the weather in Paris?"},
        {
            "type": "function_call",
            "id": call.id,
            "status": "completed",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
    ]
    answer = client.responses.create(
        model=qwen.model,
        input=history,
        tools=RESPONSES_TOOLS,
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    assert [item.type for item in answer.output] == ["message"]
    assert answer.usage.input_tokens > whole.usage.input_tokens


def test_a_call_cut_by_max_output_tokens_is_the_incomplete_item(qwen):
    """The tokens run out inside the call: the response and its last item are incomplete,
    whole and streamed; the item the SDK saw done is that item."""
    client = qwen.client()
    ask = forced_weather_call(qwen, max_output_tokens=45)
    whole = client.responses.create(**ask)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [(item.type, item.status) for item in whole.output] == [("function_call", "incomplete")]
    with client.responses.stream(**ask) as stream:
        events = list(stream)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    streamed = events[-1].response
    assert events[-1].type == "response.incomplete"
    assert [(i.type, i.status) for i in streamed.output] == [("function_call", "incomplete")]
    assert [(i.type, i.status, i.arguments) for i in done] == [
        ("function_call", "incomplete", whole.output[0].arguments)
    ]


def test_a_custom_tool_is_called_with_its_freeform_input(qwen):
    client = qwen.client()
    patch = {
        "type": "custom",
        "name": "apply_patch",
        "description": "Edit files.",
        "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin"'},
    }
    ask = dict(
        model=qwen.model,
        input="Fix it.",
        tools=[patch],
        temperature=0,
        tool_choice={"type": "custom", "name": "apply_patch"},
        max_output_tokens=60,
    )
    whole = client.responses.create(**ask)
    (call,) = whole.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch"
    assert call.input == "*** Begin"  # the tool's Lark grammar, honoured
    streamed, kinds = streamed_response(client, **ask)
    assert _output(streamed) == _output(whole)
    assert "response.custom_tool_call_input.done" in kinds


def test_tools_it_cannot_run_are_left_out_and_named(qwen):
    client = qwen.client()
    tools = [
        *RESPONSES_TOOLS,
        {"type": "web_search", "external_web_access": False},
        {
            "type": "namespace",
            "name": "agents",
            "description": "Sub-agents.",
            "tools": [
                {
                    "type": "function",
                    "name": "spawn_agent",
                    "strict": False,
                    "parameters": {"type": "object", "properties": {}},
                }
            ],
        },
    ]
    r = client.responses.create(model=qwen.model, input="Hi", tools=tools, max_output_tokens=2)
    assert r.tools_left_out == ["web_search"]
    forced = client.responses.create(
        model=qwen.model,
        input="Hi",
        tools=tools,
        max_output_tokens=40,
        temperature=0,
        tool_choice={"type": "function", "name": "spawn_agent"},
    )
    assert [item.name for item in forced.output] == ["spawn_agent"]


def test_a_json_schema_answer(qwen):
    client = qwen.client()
    fmt = {
        "format": {
            "type": "json_schema",
            "name": "weather",
            "schema": ANSWER_SCHEMA,
            "strict": True,
        }
    }
    ask = dict(model=qwen.model, input="Weather?", text=fmt, temperature=0, max_output_tokens=80)
    whole = client.responses.create(**ask)
    value = json.loads(whole.output_text)
    assert set(value) == {"city", "sunny"} and isinstance(value["sunny"], bool)
    streamed, _ = streamed_response(client, **ask)
    assert _output(streamed) == _output(whole)


# ---- Messages ----


def test_a_messages_text_turn_whole_and_streamed(demo):
    client = claude(demo)
    ask = dict(
        model=demo.model,
        max_tokens=12,
        messages=[{"role": "user", "content": "Hello"}],
        extra_body={"temperature": 0},
    )
    whole = client.messages.create(**ask)
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    assert whole.sampling["source"]["temperature"] == "request"
    assert whole.quality["degenerate"] is False
    with client.messages.stream(**ask) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert [b.text for b in streamed.content] == [b.text for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason and streamed.usage == whole.usage
    assert streamed.sampling == whole.sampling  # from message_start
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.quality == whole.quality and delta.sampling == whole.sampling
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"


def test_claude_codes_request_shape_is_served(demo):
    """What Claude Code sends: max_tokens 32,000 (cut to the room, adjusted), thinking,
    output_config, context_management, cache_control, metadata, a system message inside
    messages, the beta query and headers."""
    client = claude(demo, default_headers={"anthropic-beta": "claude-code-20250219"})
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.123; cch=1;"},
        {
            "type": "text",
            "text": "You are a careful agent.",
            "cache_control": {"type": "ephemeral"},
        },
    ]
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hello", "cache_control": {"type": "ephemeral"}}],
        },
        {"role": "system", "content": "Agent types: none."},
    ]
    with client.messages.stream(
        model=demo.model,
        max_tokens=32000,
        system=system,
        messages=messages,
        stop_sequences=["\n"],
        metadata={"user_id": "u"},
        extra_body={
            "thinking": {"type": "adaptive"},
            "output_config": {"effort": "high"},
            "context_management": {"edits": []},
        },
        extra_query={"beta": "true"},
    ) as stream:
        message = stream.get_final_message()
    (adjusted,) = message.sampling["adjusted"]
    assert adjusted["param"] == "max_tokens" and adjusted["requested"] == 32000
    assert adjusted["policy"] == "context_length" and adjusted["applied"] < 1024
    assert message.stop_reason in ("stop_sequence", "max_tokens", "end_turn")
    if message.stop_reason == "stop_sequence":
        assert message.stop_sequence == "\n"


def test_the_billing_line_does_not_defeat_the_prefix_cache(demo):
    client = claude(demo)
    rules = "You are a careful coding agent. " * 40

    def turn(nonce: str, messages: list) -> anthropic.types.Message:
        system = [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2; cch={nonce};"},
            {"type": "text", "text": rules},
        ]
        return client.messages.create(
            model=demo.model, max_tokens=4, system=system, messages=messages
        )

    first = turn("a1", [{"role": "user", "content": "Hello"}])
    other_session = turn("b2", [{"role": "user", "content": "Hi"}])
    assert other_session.usage.cache_read_input_tokens >= 256  # the shared system prompt
    second_turn = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": [{"type": "text", "text": first.content[0].text}]},
        {"role": "user", "content": "Go on"},
    ]
    second = turn("c3", second_turn)
    total = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= total - 32  # all but the last blocks
    counted = client.messages.count_tokens(model=demo.model, system=rules, messages=second_turn)
    assert counted.input_tokens == total


def test_a_forced_tool_use_whole_and_streamed_then_a_tool_result(qwen):
    client = claude(qwen)
    ask = dict(
        model=qwen.model,
        max_tokens=120,
        tools=MESSAGES_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        extra_body={"temperature": 0},
    )
    whole = client.messages.create(**ask)
    assert whole.stop_reason == "tool_use"
    (use,) = whole.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert set(use.input) == {"city", "unit"}
    with client.messages.stream(**ask) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [
        (use.type, use.name, use.input)
    ]
    assert "input_json" in kinds or "content_block_delta" in kinds
    turn = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [whole.content[0].model_dump()]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": "Sunny",
                    "is_error": False,
                }
            ],
        },
    ]
    answer = client.messages.create(
        model=qwen.model,
        max_tokens=6,
        tools=MESSAGES_TOOLS,
        tool_choice={"type": "none"},
        messages=turn,
    )
    assert [b.type for b in answer.content] == ["text"]
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )


def test_server_tools_are_left_out_and_named(qwen):
    client = claude(qwen)
    tools = [*MESSAGES_TOOLS, {"type": "web_search_20250305", "name": "web_search"}]
    m = client.messages.create(
        model=qwen.model, max_tokens=2, tools=tools, messages=[{"role": "user", "content": "Hi"}]
    )
    assert m.tools_left_out == ["web_search"]


# ---- bad input, in each API's shape ----


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens: Field required"),
        ({"max_tokens": 4, "messages": []}, 400, "messages: must not be empty"),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            400,
            "image blocks are not supported",
        ),
        ({"max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]}, 400, "role"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "nope"}]}]},
            400,
            "'nope'",
        ),
        (
            {"max_tokens": 4, "model": "claude-x", "messages": [{"role": "user", "content": "x"}]},
            404,
            "not served here",
        ),
        (
            {
                "max_tokens": 4,
                "tools": [{"name": "t"}],
                "messages": [{"role": "user", "content": "x"}],
            },
            400,
            "input_schema",
        ),
        ({"max_tokens": "4", "messages": []}, 400, "max_tokens"),
    ],
)
def test_bad_messages_are_4xx_in_anthropics_shape(demo, body, status, words):
    r = httpx.post(f"{demo.url}/v1/messages", json=body)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and words in error["error"]["message"]
    kind = {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert error["error"]["type"] == kind


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({}, "input: is required"),
        ({"input": []}, "input: must not be empty"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "'item_reference'"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "not supported"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "call_id"),
        ({"input": "x", "tools": [{"name": "f"}]}, "tools[0].type"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "resp_nope"),
    ],
)
def test_bad_responses_are_4xx_in_openais_shape(demo, body, words):
    r = httpx.post(f"{demo.url}/v1/responses", json=body)
    assert 400 <= r.status_code < 500, r.text
    assert words in r.json()["error"]["message"]


def test_content_type_malformed_json_and_the_key_as_x_api_key(demo):
    for path in ("/v1/messages", "/v1/responses"):
        r = httpx.post(f"{demo.url}{path}", content="{}", headers={"content-type": "text/plain"})
        assert r.status_code == 415
        r = httpx.post(
            f"{demo.url}{path}", content="{", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and "malformed JSON" in r.text
    assert httpx.head(f"{demo.url}/").status_code == 200  # Claude Code's probe
    with running_server("demo", api_key="sesame") as s:
        body = {"model": s.model, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
        refused = httpx.post(f"{s.url}/v1/messages", json=body)
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        assert (
            httpx.post(
                f"{s.url}/v1/messages", json=body, headers={"x-api-key": "sesame"}
            ).status_code
            == 200
        )
        m = anthropic.Anthropic(base_url=s.url, api_key="sesame", max_retries=0).messages.create(
            model=s.model, max_tokens=1, messages=[{"role": "user", "content": "x"}]
        )
        assert m.usage.output_tokens == 1


def test_metrics_and_the_console_name_the_api(demo):
    client = demo.client()
    client.responses.create(model=demo.model, input="Hi", max_output_tokens=1)
    claude(demo).messages.create(model=demo.model, max_tokens=1,
                                 messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
    metrics = httpx.get(f"{demo.url}/metrics").text
    for path in ("/v1/responses", "/v1/messages"):
        assert f'thermostat_requests_total{{endpoint="{path}",status="200"}}' in metrics
    rows = httpx.get(f"{demo.url}/v1/console/state").json()["requests"]
    assert {"responses", "messages"} <= {row["endpoint"] for row in rows}


def test_an_empty_streamed_answer_adds_its_message_before_closing_it(demo):
    """A first token that ends the answer (here: every token stops it) is an empty message item,
    added, then done; no delta."""
    every = list(range(4096))  # the demo model's vocabulary
    ask = dict(model=demo.model, input="Hi", max_output_tokens=8,
               extra_body={"stop_token_ids": every})  # fmt: skip
    streamed, kinds = streamed_response(demo.client(), **ask)
    assert streamed.output_text == ""
    assert "response.output_text.delta" not in kinds
    assert kinds[2:6] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done",
    ]  # fmt: skip
