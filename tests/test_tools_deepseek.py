"""DeepSeek's tool calls beyond tests/test_tools.py's shared cases: which format a checkpoint
gets (family, architecture, chat template), DSML parameters read back into OpenAI's JSON
arguments (whole, and streamed without taking back what was sent), the V3 fence, the DSML
grammar on richer schemas, and DeepSeek's templates joining a call's arguments as text."""

from __future__ import annotations

import json
import random

import jsonschema_rs
import pytest

from tests.tool_models import DEEPSEEK_CALLS, DEEPSEEK_TEMPLATE, tool_tokenizer
from thermostat.api.protocol import ChatCompletionRequest, ChatMessage
from thermostat.api.tool_parsers import PARSERS, marker_tokens, parser_for
from thermostat.api.tool_parsers_deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, SEP
from thermostat.api.tool_parsers_deepseek import DSML as D
from thermostat.api.tools import ToolRequest, ToolStream
from thermostat.engine.constraint import ConstraintCompiler, allowed_ids
from thermostat.server.prompts import PromptBuilder

V3_TEMPLATE = DEEPSEEK_TEMPLATE.replace("CALL", DEEPSEEK_CALLS["deepseek_v3"])
V31_TEMPLATE = DEEPSEEK_TEMPLATE.replace("CALL", DEEPSEEK_CALLS["deepseek_v31"])


def test_a_deepseek_checkpoint_gets_its_format():
    v3 = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}
    assert parser_for(v3).name == "deepseek_v3"  # not hermes any more
    assert parser_for({"model_type": "deepseek_v2"}).name == "deepseek_v3"
    assert parser_for({"architectures": ["DeepseekV4ForCausalLM"]}).name == "deepseek_v4"
    assert parser_for({"model_type": "deepseek_v4"}).name == "deepseek_v4"
    assert parser_for({"model_type": "deepseek_v32"}).name == "deepseek_v32"  # no template
    assert parser_for(v3, template=V3_TEMPLATE).name == "deepseek_v3"
    assert parser_for(v3, template=V31_TEMPLATE).name == "deepseek_v31"  # V3.1's config is V3's
    exp = {"model_type": "deepseek_v32"}  # V3.2-Exp ships V3.1's template
    assert parser_for(exp, template={"default": V31_TEMPLATE}).name == "deepseek_v31"
    assert parser_for(v3, template=f"<{D}tool_calls>").name == "deepseek_v4"
    assert parser_for(v3, template=f"<{D}function_calls>").name == "deepseek_v32"
    assert parser_for({"model_type": "qwen3"}, template=V3_TEMPLATE).name == "hermes"
    assert parser_for(v3, "hermes", template=V3_TEMPLATE).name == "hermes"


def _streamed(parser, text: str, rng: random.Random) -> list[tuple[str, str]]:
    """The calls a stream of `text` in random pieces sends; each read resumed as a whole read."""
    stream, calls, i = ToolStream(parser), {}, 0
    while i < len(text):
        step = rng.randint(1, 4)
        delta = stream.feed(text[i : i + step], finished=i + step >= len(text))
        i += step
        assert stream.read == parser.read(text[:i])
        for piece in (delta.tool_calls if delta else None) or []:
            if piece.id is not None:
                calls[piece.index] = [piece.function.name, ""]
            calls[piece.index][1] += piece.function.arguments or ""
    return [tuple(calls[k]) for k in sorted(calls)]


def _invoke(name: str, *params: tuple[str, bool, str]) -> str:
    body = "".join(
        f'<{D}parameter name="{k}" string="{str(s).lower()}">{v}</{D}parameter>\n'
        for k, s, v in params
    )
    return f'<{D}invoke name="{name}">\n{body}</{D}invoke>'


def test_dsml_parameters_become_the_json_arguments_openai_carries():
    """Strings as they are (quotes, newlines, `<`, non-ASCII) come back JSON-quoted; other
    values as the JSON written; an invoke without parameters is `{}`; one whose body is a JSON
    object is those arguments; a stream sends the same text, never taking back a piece."""
    text = (
        f"I will call.\n\n<{D}tool_calls>\n"
        + _invoke(
            "write",
            ("path", True, 'a "b"\nc < d 日本'),
            ("lines", False, "[1, 2]"),
            ("opts", False, ' {"x": null, "y": true} '),
        )
        + "\n"
        + _invoke("ping")
        + f'\n<{D}invoke name="f">\n{{"a": [1, {{"b": "c"}}]}}\n</{D}invoke>'
        + f"\n</{D}tool_calls>"
    )
    parser = PARSERS["deepseek_v4"]()
    read = parser.read(text)
    assert read.valid and read.content == "I will call."
    args = [json.loads(c.arguments) for c in read.calls]
    assert [c.name for c in read.calls] == ["write", "ping", "f"]
    assert args == [
        {"path": 'a "b"\nc < d 日本', "lines": [1, 2], "opts": {"x": None, "y": True}},
        {},
        {"a": [1, {"b": "c"}]},
    ]
    assert read.calls[0].arguments.startswith('{"path": "a \\"b\\"\\nc < d 日本", "lines": [1')
    whole = [(c.name, c.arguments) for c in read.calls]
    for seed in range(10):
        assert _streamed(parser, text, random.Random(seed)) == whole
    v32 = PARSERS["deepseek_v32"]()  # its block is function_calls; V4's is not its start
    assert v32.read(text.replace("tool_calls>", "function_calls>")).calls == read.calls
    assert not v32.read(text).calls and v32.read(text).content == text.rstrip()


def test_a_dsml_call_read_so_far():
    parser = PARSERS["deepseek_v4"]()
    head = f'\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
    open_string = head + f'<{D}parameter name="city" string="true">Par'
    call = parser.read(open_string).calls[0]
    assert (call.name, call.arguments, call.complete) == ("get_weather", '{"city": "Par', False)
    held = parser.read(open_string + "is</").calls[0]  # the tag's start is held back
    assert held.arguments == '{"city": "Paris'
    bad = head + f'<{D}parameter name="n" string="false">{{oops</{D}parameter>\n</{D}invoke>'
    read = parser.read(bad)  # closed, but its value is not JSON: not a whole call
    assert read.calls[0].name == "get_weather" and not read.valid
    assert parser.read(f"Hi <{D}tool").content == "Hi"  # could begin the block: held


def test_deepseek_v3_reads_its_fence_and_pretty_json():
    parser = PARSERS["deepseek_v3"]()
    pretty = '{\n  "city": "Paris",\n  "unit": "C"\n}'
    text = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{pretty}\n```{CALL_END}"
    read = parser.read(text)
    assert read.valid and read.calls[0].arguments == pretty
    for seed in range(5):
        assert _streamed(parser, text, random.Random(seed)) == [("get_weather", pretty)]
    partial = parser.read(text[: text.index("```json") + 3])
    assert partial.calls[0].name == "get_weather" and partial.calls[0].arguments == ""


@pytest.mark.parametrize("name", ["deepseek_v4", "deepseek_v32"])
def test_dsml_grammar_on_richer_schemas(name):
    """Optional parameters, objects and arrays, a `$ref`, a string with a pattern (JSON, as
    `string="false"`): random walks read back into arguments that meet the schema; a schema a
    property list cannot hold (other keys allowed) is written as one JSON object."""
    rich = {
        "type": "object",
        "$defs": {"unit": {"enum": ["C", "F"]}},
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 8},
            "unit": {"$ref": "#/$defs/unit"},
            "days": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
            "code": {"type": "string", "pattern": "^[A-Z]{2}$"},
            "flags": {"type": "object", "properties": {"hot": {"type": "boolean"}}},
        },
        "required": ["city", "code"],
        "additionalProperties": False,
    }
    loose = {
        "type": "object",
        "properties": {"q": {"type": "string", "maxLength": 4}},
        "additionalProperties": {"type": "integer"},
    }
    tools = [
        {"type": "function", "function": {"name": "rich", "parameters": rich}},
        {"type": "function", "function": {"name": "loose", "parameters": loose}},
    ]
    tokenizer = tool_tokenizer(name, "added")
    parser = PARSERS[name](marker_tokens(tokenizer.added_tokens_decoder))
    compiler = ConstraintCompiler(tokenizer, 320, (0,))
    rng = random.Random(4)
    for choice in ("rich", "loose"):
        named = {"type": "function", "function": {"name": choice}}
        body = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": named}
        )
        request = ToolRequest.of(body, parser)
        assert request is not None and (spec := request.constraint()) is not None
        schema = rich if choice == "rich" else loose
        for _ in range(8):
            constraint, ids = compiler.compile(spec), []
            while not constraint.complete and len(ids) < 3000:
                token = rng.choice(allowed_ids(constraint.mask(), 320))
                assert constraint.advance(token)
                ids.append(token)
            text = tokenizer.decode([t for t in ids if t != 0])
            read = parser.read(text)
            assert read.valid and len(read.calls) == 1, text
            jsonschema_rs.validate(schema, json.loads(read.calls[0].arguments))
            if choice == "loose":
                assert f'<{D}invoke name="loose">\n{{' in text  # one JSON object
            else:
                assert (
                    'name="city" string="true">' in text and 'name="code" string="false">"' in text
                )


def test_deepseek_templates_get_arguments_as_text():
    """DeepSeek's templates join a call's arguments with `+`: they get the JSON text (a
    mapping, as other templates get, would fail them)."""
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "done"},
    ]
    for name, template, written in (
        ("deepseek_v3", V3_TEMPLATE, f'function{SEP}f\n```json\n{{"a": 1}}\n```{CALL_END}'),
        ("deepseek_v31", V31_TEMPLATE, f'{CALL_BEGIN}f{SEP}{{"a": 1}}{CALL_END}'),
    ):
        tokenizer = tool_tokenizer(name, "added")
        tokenizer.chat_template = template
        text = PromptBuilder(tokenizer, 512).chat_text(
            [ChatMessage.model_validate(m) for m in messages]
        )
        assert written in text
