"""DeepSeek's DSML tool calls (V3.2, V4): an XML-like block whose tags begin with the added
token `｜DSML｜` (id 128825 in their tokenizers; not special), one parameter per tag.

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

| parser         | block            | source                                                     |
|----------------|------------------|------------------------------------------------------------|
| `deepseek_v32` | `function_calls` | encoding/encoding_dsv32.py of the DeepSeek-V3.2 checkpoint |
| `deepseek_v4`  | `tool_calls`     | encoding/encoding_dsv4.py of the DeepSeek-V4 checkpoints   |

The block follows the content after a blank line; invokes, and parameters within one, are
joined by newlines. A parameter whose value is a string says `string="true"` and writes it as
it is (no quotes, no escapes); any other value is JSON with `string="false"`. Read back, the
arguments are the JSON object OpenAI's `function.arguments` carries, as the encoder's decoder
writes it: `{"city": "Paris", "days": 3}` (keys in the model's order, a string JSON-quoted, a
JSON value as written). Read by prefix as tool_parsers.py does: what a stream has sent of the
arguments is never taken back (an open string is sent quoted but not closed). An invoke whose
body is a JSON object is read as those arguments (SGLang's readers accept that form too).

The forced call's grammar writes the block, the invokes and each parameter's tag as fixed text
(`｜DSML｜` as its token) and generates only values: in the schema's order of properties
(required ones always, others optionally), a plain string schema (enum, const, or length bounds
only) as raw text without `<`, any other value to its schema as JSON. Parameters that a
property list cannot hold (no `properties`, other keys allowed, `anyOf` at the top) are written
as one JSON object in the invoke, the form above.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from thermostat.api.tool_base import ToolParser, split_at
from thermostat.api.tool_json import CallSoFar
from thermostat.api.tool_parsers_deepseek import DSML, hold, parses

HEAD = re.compile(r'\s*name="([^"]*)"\s*>')
PARAM_HEAD = re.compile(r'\s*name="([^"]*)"\s*string="(true|false)"\s*>')
INVOKE, INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"
PARAM, PARAM_END = f"<{DSML}parameter", f"</{DSML}parameter>"
RAW_KEYS = {"type", "minLength", "maxLength", "title", "description", "default", "examples"}


class DsmlParser(ToolParser):
    """One DSML format; subclasses set `BLOCK`, the block's tag."""

    markers = (DSML,)
    BLOCK: ClassVar[str]

    def start(self, text: str) -> tuple[str, int | None]:
        return split_at(text, f"<{DSML}{self.BLOCK}>")

    def calls_from(self, text: str, i: int) -> tuple[list[CallSoFar], int, int]:
        calls: list[CallSoFar] = []
        resume = i
        while (begin := text.find(INVOKE, i)) >= 0:
            call, end = read_invoke(text, begin + len(INVOKE))
            if end is None:
                return [*calls, call], resume, len(calls)
            calls.append(call)
            i = resume = end
        return calls, resume, len(calls)

    def frame(self, call: str, parallel: bool) -> str:
        d = self.lit(DSML)
        more = ' ("\\n" tool_call)*' if parallel else ""
        open_, close = f'"\\n\\n<" {d} "{self.BLOCK}>\\n"', f'"\\n</" {d} "{self.BLOCK}>"'
        return f"start: {open_} tool_call{more} {close}\ntool_call: {call}"

    def grammar(self, calls: Mapping[str, dict[str, Any]], parallel: bool) -> str:
        d = self.lit(DSML)
        rules = [self.frame(" | ".join(f"call{k}" for k in range(len(calls))), parallel)]
        for k, (name, params) in enumerate(calls.items()):
            head = f'"<" {d} {json.dumps(f"invoke name={_attr(name)}>")} "\\n"'
            end = f'"</" {d} "invoke>"'
            listed = _listed(params)
            if listed is None:  # one JSON object
                rules.append(f'call{k}: {head} args{k} "\\n" {end}')
                rules.append(f"args{k}: %json {json.dumps(params)}")
                continue
            body = []
            for j, (key, schema, required) in enumerate(listed):
                rule, extra = self._parameter(f"p{k}_{j}", key, schema, params)
                rules.extend(extra)
                body.append(f'{rule} "\\n"' if required else f'({rule} "\\n")?')
            rules.append(f"call{k}: {' '.join([head, *body, end])}")
        return "\n".join(rules) + "\n"

    def _parameter(
        self, rule: str, key: str, schema: Any, params: dict[str, Any]
    ) -> tuple[str, list[str]]:
        """The Lark expression of one parameter's tag and value, and the rules it uses."""
        d = self.lit(DSML)
        raw = _raw(schema)
        flag = "true" if raw is not None else "false"
        text = f'parameter name={_attr(key)} string="{flag}">'
        tag = f'"<" {d} {json.dumps(text)}'
        end = f'"</" {d} "parameter>"'
        if raw is not None:
            return f"{tag} {raw} {end}" if raw else f"{tag} {end}", []
        value = dict(schema) if isinstance(schema, dict) else {}
        for shared in ("x-guidance", "$defs", "definitions"):  # options, and what $ref names
            if shared in params:
                value[shared] = params[shared]
        return f"{tag} {rule} {end}", [f"{rule}: %json {json.dumps(value)}"]


class DeepSeekV32Parser(DsmlParser):
    name = "deepseek_v32"
    BLOCK = "function_calls"


class DeepSeekV4Parser(DsmlParser):
    name = "deepseek_v4"
    BLOCK = "tool_calls"


def read_invoke(text: str, i: int) -> tuple[CallSoFar, int | None]:
    """The invoke from `text[i]` (past `<｜DSML｜invoke`), and one past its end (None if
    open)."""
    head = HEAD.match(text, i)
    if head is None:
        return CallSoFar(), None
    call = CallSoFar(head.group(1))
    close = text.find(INVOKE_END, head.end())
    body = text[head.end() : len(text) if close < 0 else close]
    if body.lstrip().startswith("{"):  # the arguments as one JSON object
        call.arguments = (body if close >= 0 else hold(body, INVOKE_END)).strip()
        whole = close >= 0
    else:
        call.arguments, whole = read_parameters(body, close >= 0)
    call.complete = close >= 0 and whole and parses(call.arguments)
    return call, None if close < 0 else close + len(INVOKE_END)


def read_parameters(body: str, closed: bool) -> tuple[str, bool]:
    """The JSON object of an invoke's parameters so far (unclosed while the invoke or its last
    parameter is open), and whether every parameter is whole."""
    pieces: list[str] = []
    i, whole = 0, True
    while (begin := body.find(PARAM, i)) >= 0:
        head = PARAM_HEAD.match(body, begin + len(PARAM))
        if head is None:
            whole = False
            break
        end = body.find(PARAM_END, head.end())
        value = body[head.end() : len(body) if end < 0 else end]
        key = json.dumps(head.group(1), ensure_ascii=False)
        if head.group(2) == "true":
            quoted = json.dumps(value if end >= 0 else hold(value, PARAM_END), ensure_ascii=False)
            value = quoted if end >= 0 else quoted[:-1]
        else:
            value = (value if end >= 0 else hold(value, PARAM_END)).strip()
        pieces.append(f"{key}: {value}")
        if end < 0:
            whole = False
            break
        i = end + len(PARAM_END)
    text = "{" + ", ".join(pieces)
    return (text + "}" if closed and whole else text), whole


def _listed(params: dict[str, Any]) -> list[tuple[str, Any, bool]] | None:
    """The parameters as (key, schema, required) in the schema's order, or None where a list
    of properties cannot hold them."""
    properties = params.get("properties", {})
    required = params.get("required", [])
    if (
        params.get("type", "object") != "object"
        or not isinstance(properties, dict)
        or params.get("additionalProperties", True) is not False
        or any(k in params for k in ("anyOf", "oneOf", "allOf", "patternProperties", "$ref"))
        or not set(required) <= set(properties)
    ):
        return None
    return [(key, schema, key in required) for key, schema in properties.items()]


def _raw(schema: Any) -> str | None:
    """The Lark expression of a value written as raw text (a string schema that raw text can
    meet: enum, const, length bounds), "" for the empty string only; None: JSON."""
    if not isinstance(schema, dict):
        return None
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        if not values or not all(isinstance(v, str) and v and "<" not in v for v in values):
            return None
        return "(" + " | ".join(json.dumps(v) for v in values) + ")"
    if schema.get("type") != "string" or not set(schema) <= RAW_KEYS:
        return None
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    if high is not None and int(high) == 0:
        return ""
    bounds = f"{{{max(low, 1)},{'' if high is None else int(high)}}}"
    text = f"/[^<]{bounds}/"
    return text if low > 0 else f"({text})?"


def _attr(value: str) -> str:
    """An attribute's value as DSML writes it: in double quotes, as it is."""
    return f'"{value}"'
