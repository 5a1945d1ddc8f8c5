"""Tool calling: the parsers (whole and streamed), the forced-call grammar, and the server's
tools / tool_choice / parallel_tool_calls through the official openai client, on tiny random
Qwen3, Llama, Mistral and DeepSeek-V3 models (real-shaped markers and DeepSeek's V3, V3.1 and V4
formats: tests/tool_models.py) and the demo model,
including a multi-turn tool loop and a call cut by max_tokens, streamed and whole."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from tests.server_utils import running_server
from tests.tool_models import tool_tokenizer, write_tool_model
from thermostat.api.tool_parsers import PARSERS, marker_tokens, parser_for
from thermostat.api.tool_parsers_deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from thermostat.api.tool_parsers_deepseek import DSML as D
from thermostat.api.tools import ToolStream
from thermostat.engine.constraint import ConstraintCompiler, allowed_ids

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED_X = {"type": "function", "function": {"name": "x"}}

SAMPLES = {
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",'
    ' "unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}'
    "\n</tool_call>",
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; '
    '{"name": "get_time", "parameters": {"zone": 1}}',
    "mistral": 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '
    '"Paris", "unit": "C"}}, {"name": "get_time", "arguments": {"zone": 1}}]',
    # DeepSeek V3 / R1 (their chat templates), V3.1 (its template and model card)
    "deepseek_v3": f"Let me check.{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n"
    f'{{"city": "Paris", "unit": "C"}}\n```{CALL_END}\n{CALL_BEGIN}function{SEP}get_time\n'
    f'```json\n{{"zone": 1}}\n```{CALL_END}{CALLS_END}',
    "deepseek_v31": f'Let me check.{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{"city": '
    f'"Paris", "unit": "C"}}{CALL_END}{CALL_BEGIN}get_time{SEP}{{"zone": 1}}{CALL_END}{CALLS_END}',
    # DeepSeek V4 (encoding/encoding_dsv4.py): one tag per parameter, strings as they are
    "deepseek_v4": f'Let me check.\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}'
    f'parameter name="city" string="true">Paris</{D}parameter>\n<{D}parameter name="unit" '
    f'string="true">C</{D}parameter>\n</{D}invoke>\n<{D}invoke name="get_time">\n<{D}parameter'
    f' name="zone" string="false">1</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>',
}
SAMPLES["deepseek_v32"] = SAMPLES["deepseek_v4"].replace("tool_calls>", "function_calls>")
# what follows the last call's end
TAILS = {"mistral": "]", "deepseek_v3": CALLS_END, "deepseek_v31": CALLS_END}
TAILS |= {
    f"deepseek_v{v}": f"\n</{D}{b}>" for v, b in (("32", "function_calls"), ("4", "tool_calls"))
}
# the fixed text of a forced call of get_time
ENVELOPES = {
    "hermes": '{"name": "get_time", "arguments": ',
    "llama3_json": '{"name": "get_time", "parameters": ',
    "mistral": '{"name": "get_time", "arguments": ',
    "deepseek_v3": f"{CALL_BEGIN}function{SEP}get_time\n```json\n",
    "deepseek_v31": f"{CALL_BEGIN}get_time{SEP}",
    "deepseek_v32": f'<{D}invoke name="get_time">\n<{D}parameter name="zone" string="false">',
    "deepseek_v4": f'<{D}invoke name="get_time">\n<{D}parameter name="zone" string="false">',
}


# ---- parsers ----


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_parsers_read_whole_outputs_and_streams_join_to_the_same(name):
    parser = PARSERS[name]()
    text = SAMPLES[name]
    read = parser.read(text)
    assert read.valid
    assert [(c.name, json.loads(c.arguments)) for c in read.calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}),
        ("get_time", {"zone": 1}),
    ]
    assert read.content == ("" if name == "llama3_json" else "Let me check.")
    rng = random.Random(0)
    for _ in range(20):  # random chunkings of the same text
        stream, content, calls = ToolStream(parser), "", {}
        i = 0
        while i < len(text):
            step = rng.randint(1, 6)
            delta = stream.feed(text[i : i + step], finished=i + step >= len(text))
            i += step
            assert stream.read == parser.read(text[:i])  # resumed, read the same
            if delta is None:
                continue
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                if piece.id is not None:
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
        assert content == read.content
        assert [tuple(calls[i]) for i in sorted(calls)] == [
            (c.name, c.arguments) for c in read.calls
        ]
        resume = len(text) - len(TAILS.get(name, ""))
        assert stream.read.settled == 2 and stream.read.resume == resume


def test_a_stream_resumes_past_closed_calls_and_sends_text_no_call_took():
    """The stream reads each token's text from its last closed call on (the format's start is
    not looked for again); a text whose call never got a name is sent whole at the end, as
    the whole answer gives it."""
    from thermostat.api.tools import answer

    parser = PARSERS["hermes"]()
    starts = 0
    start = parser.start

    def counted(text):
        nonlocal starts
        starts += 1
        return start(text)

    parser.start = counted  # type: ignore[method-assign]
    stream = ToolStream(parser)
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
    for piece in ["Hi ", call[:5], call[5:]] + list(call * 20):
        stream.feed(piece)
    assert starts == 3 and stream.read.settled == 21 and len(stream.read.named) == 21
    for text in ("Hi there\n", 'Hi <tool_call>\n{"na', "Hi [TOOL_CALLS]"):
        stream, sent = ToolStream(PARSERS["hermes"]()), ""
        for k, ch in enumerate(text):
            delta = stream.feed(ch, finished=k == len(text) - 1)
            sent += (delta.content or "") if delta else ""
            assert not (delta and delta.tool_calls)
        assert sent == text == answer(text, stream.read).content


def test_plain_text_is_content_and_not_a_call():
    for name in PARSERS:
        read = PARSERS[name]().read("Hello there")
        assert read.content == "Hello there" and not read.valid


def test_parser_by_family_and_override():
    assert parser_for({"model_type": "qwen3"}).name == "hermes"
    assert parser_for({"model_type": "llama"}).name == "llama3_json"
    assert parser_for({"model_type": "mistral"}).name == "mistral"
    assert parser_for({"model_type": "llama", "thermostat_family": "thermostat-demo"}).name == (
        "hermes"
    )
    assert parser_for({"model_type": "llama"}, "mistral").name == "mistral"


@pytest.mark.parametrize("markers", ["plain", "added", "special"])
@pytest.mark.parametrize("name", sorted(PARSERS))
def test_forced_call_grammar_only_admits_calls_the_parser_reads(name, markers):
    """Random walks through each parser's required-call grammar always parse into valid calls
    of the given tools, with arguments that match their schemas, whether the tokenizer holds
    the format's markers as text, added tokens (Qwen's) or special tokens (Mistral's): the
    grammar writes the call's envelope, a marker token as that token (fault (a) of issue 18:
    an added `<tool_call>` dead-ended the call)."""
    from thermostat.api.protocol import ChatCompletionRequest
    from thermostat.api.tools import ToolRequest

    tokenizer = tool_tokenizer(name, markers)
    parser = PARSERS[name](marker_tokens(tokenizer.added_tokens_decoder))
    assert parser.keeps_special == (markers == "special" and name != "llama3_json")
    compiler = ConstraintCompiler(tokenizer, 320, (0,))
    rng = random.Random(1)
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        for parallel in (True, False):
            body = ChatCompletionRequest.model_validate(
                {
                    "messages": ASK,
                    "tools": TOOLS,
                    "tool_choice": choice,
                    "parallel_tool_calls": parallel,
                }
            )
            request = ToolRequest.of(body, parser)
            assert request is not None
            spec = request.constraint()
            assert spec is not None and spec.kind == "tool_call"
            for _ in range(10):
                constraint = compiler.compile(spec)
                ids: list[int] = []
                while not constraint.complete and len(ids) < 2000:
                    token = rng.choice(allowed_ids(constraint.mask(), 320))
                    assert constraint.advance(token)
                    ids.append(token)
                skip = not parser.keeps_special
                text = tokenizer.decode([t for t in ids if t != 0], skip_special_tokens=skip)
                read = parser.read(text)
                assert read.valid, text
                for marker, token in parser.tokens.items():  # written as the token, not text
                    assert token.id in ids and marker not in tokenizer.decode(
                        [t for t in ids if t != token.id], skip_special_tokens=False
                    )
                assert choice == "required" or ENVELOPES[name] in text  # fixed: fault (b)
                if not parallel:
                    assert len(read.calls) == 1
                for call in read.calls:
                    assert call.name == "get_time" or choice == "required"
                    args = json.loads(call.arguments)
                    if call.name == "get_time":
                        assert set(args) == {"zone"} and -12 <= args["zone"] <= 12
                    else:
                        assert set(args) == {"city", "unit"} and args["unit"] in "CF"


def test_the_constraint_hash_is_of_the_call_schema_whatever_the_format():
    """serve's hash (any parser, markers as tokens or text) is the gateway's."""
    from thermostat.api.protocol import ChatCompletionRequest
    from thermostat.api.tools import ToolRequest, tool_constraint

    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        body = ChatCompletionRequest.model_validate(
            {"messages": ASK, "tools": TOOLS, "tool_choice": choice}
        )
        digests = set()
        for name, parser in PARSERS.items():
            for markers in ("plain", "added"):
                tokens = marker_tokens(tool_tokenizer(name, markers).added_tokens_decoder)
                request = ToolRequest.of(body, parser(tokens))
                spec = request.constraint() if request is not None else None
                assert spec is not None
                digests.add(spec.digest)
        gateway = tool_constraint(body)
        assert gateway is not None and digests == {gateway.digest}
    odd = {"type": "function", "function": {"name": 'a"\ud800\n'}}  # json.loads lets it in
    body = ChatCompletionRequest.model_validate(
        {"messages": ASK, "tools": [odd], "tool_choice": "required"}
    )
    assert tool_constraint(body) is not None  # a grammar and a hash, no 500


# ---- the server ----


@pytest.fixture(
    scope="module",
    params=["qwen3", "llama", "mistral", "demo", "deepseek_v3", "deepseek_v4"],
)
def server(request, tmp_path_factory):
    """Real-shaped markers (tests/tool_models.py): Qwen's and DeepSeek's added, Llama's and
    Mistral's special, the demo's plain text; DeepSeek-V3's fenced JSON told by its chat
    template, V4's DSML by its model type (a V4 model). V3.1's format, which differs from V3's
    only in the envelope's text, is checked at the parser and grammar level above."""
    path = write_tool_model(tmp_path_factory.mktemp("m"), request.param)
    with running_server(path) as s:
        yield s


def _args(call) -> dict:
    return json.loads(call.function.arguments)


def test_required_and_named_tool_choice_streaming_and_not(server):
    client = server.client()
    out = client.chat.completions.create(
        model=server.model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(_args(call), dict)
    assert out.model_extra["sampling"]["constraint"]["kind"] == "tool_call"

    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model=server.model, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=200
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and _args(call)["unit"] in ("C", "F")

    stream = client.chat.completions.create(
        model=server.model,
        messages=ASK,
        tools=TOOLS,
        tool_choice=named,
        max_tokens=200,
        seed=3,
        stream=True,
    )
    calls: dict[int, list] = {}
    finish = None
    pieces = 0
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for piece in c.delta.tool_calls or []:
                if piece.id is not None:
                    assert piece.id.startswith("call_") and piece.type == "function"
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
                pieces += 1
    assert finish == "tool_calls" and pieces > 2  # the arguments came in pieces
    ((name, arguments),) = calls.values()
    assert name == "get_weather" and json.loads(arguments)["unit"] in ("C", "F")


def _streamed(client, **kwargs) -> tuple[str | None, str, list[tuple[str, str]]]:
    """A streamed chat's finish_reason, content and calls (name, arguments), joined."""
    finish, content, calls = None, "", {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            content += c.delta.content or ""
            for piece in c.delta.tool_calls or []:
                if piece.id is not None:
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
    return finish, content, [tuple(calls[i]) for i in sorted(calls)]


def test_a_forced_call_cut_by_max_tokens_ends_the_same_streamed_and_whole(server):
    """One rule for both: the same finish_reason ("length" for a cut call, "tool_calls" for a
    whole one), the same content and the same calls, wherever max_tokens cuts."""
    client = server.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    base = dict(model=server.model, messages=ASK, tools=TOOLS, tool_choice=named, temperature=0)
    full = client.chat.completions.create(max_tokens=200, **base)
    assert full.choices[0].finish_reason == "tool_calls"
    n = full.usage.completion_tokens
    finishes = []
    for max_tokens in sorted({1, n // 3, 2 * n // 3, n - 2, n - 1, n}):
        whole = client.chat.completions.create(max_tokens=max_tokens, **base).choices[0]
        finish, content, calls = _streamed(client, max_tokens=max_tokens, **base)
        assert finish == whole.finish_reason, max_tokens
        assert content == (whole.message.content or ""), max_tokens
        whole_calls = whole.message.tool_calls or []
        assert calls == [(c.function.name, c.function.arguments) for c in whole_calls]
        finishes.append((finish, len(calls)))
    assert ("length", 1) in finishes and finishes[-1] == ("tool_calls", 1)


def test_auto_and_none_answer_in_text_or_calls(server):
    client = server.client()
    for choice in ("auto", "none"):
        out = client.chat.completions.create(
            model=server.model,
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=8,
            temperature=0,
        )
        message = out.choices[0].message
        assert message.content is not None or message.tool_calls
        if choice == "none":
            assert message.tool_calls is None
        assert "constraint" not in out.model_extra["sampling"]


def test_a_multi_turn_tool_loop(server):
    client = server.client()
    messages: list = list(ASK)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for turn in range(2):
        out = client.chat.completions.create(
            model=server.model,
            messages=messages,
            tools=TOOLS,
            tool_choice=named,
            max_tokens=200,
        )
        message = out.choices[0].message
        (call,) = message.tool_calls
        messages.append(message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"sunny {turn}"})
    final = client.chat.completions.create(
        model=server.model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=5
    )
    assert final.choices[0].finish_reason in ("stop", "length")
    tokens = httpx.post(
        f"{server.url}/tokenize",
        json={"messages": messages, "add_generation_prompt": True},
        timeout=30,
    )
    assert tokens.status_code == 200


def test_bad_tool_requests_are_400s_naming_the_field(server):
    url = f"{server.url}/v1/chat/completions"
    base = {"messages": ASK, "max_tokens": 5}
    cases = {
        "tool_choice": {
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "x"}},
        },
        "tools": {"tools": [WEATHER, WEATHER]},
        "response_format": {
            "tools": TOOLS,
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
    }
    for param, extra in cases.items():
        response = httpx.post(url, json=base | extra, timeout=30)
        assert response.status_code == 400, (param, response.text)
        assert response.json()["error"]["param"] == param, response.text
    bad_params = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
    response = httpx.post(url, json=base | {"tools": [bad_params], "tool_choice": "required"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"


def test_llm_chat_renders_tools_as_the_server_does():
    """`LLM.chat(messages, tools=...)` prompts the model as /v1/chat/completions does (the same
    token ids as /tokenize with the tools), on the demo model's template, which shows tools."""
    from thermostat import LLM, SamplingParams
    from thermostat.engine.loader import DEMO_MODEL_DIR

    llm = LLM("demo")
    (out,) = llm.chat(ASK, SamplingParams(max_tokens=2), tools=TOOLS)
    (plain,) = llm.chat(ASK, SamplingParams(max_tokens=2))
    assert len(out.prompt_token_ids) > len(plain.prompt_token_ids)
    with running_server(DEMO_MODEL_DIR) as s:
        body = {"messages": ASK, "tools": TOOLS}
        counted = httpx.post(f"{s.url}/tokenize", json=body, timeout=60).json()["tokens"]
    assert out.prompt_token_ids == counted
