"""Tool calls in generated text: the formats model families emit, read back into OpenAI's
`tool_calls`, and written as the grammar that forces a call (`tool_choice` required or named).

| parser        | families           | a call as the model writes it                             |
|---------------|--------------------|-----------------------------------------------------------|
| `hermes`      | Qwen, Hermes, demo | `<tool_call>{"name": N, "arguments": {...}}</tool_call>`  |
| `llama3_json` | Llama 3            | `{"name": N, "parameters": {...}}` (calls joined by `; `) |
| `mistral`     | Mistral, Mixtral   | `[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]`      |

(hermes writes a newline after `<tool_call>` and before `</tool_call>`.)

Reading is by prefix (`ToolParser.read`): the text so far gives the content before the first
call and, per call, its name once complete and the raw text of its arguments so far. Streaming
diffs two reads; a finished text reads the same way, so streamed pieces join to the message.
Arguments are the model's own JSON text (what OpenAI's `function.arguments` string carries).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class CallSoFar:
    name: str | None = None  # once its JSON string is complete
    arguments: str = ""  # raw JSON text of the arguments so far
    complete: bool = False  # the call's object is closed and its arguments parse


@dataclass
class ToolText:
    """A (possibly partial) output read by a parser."""

    content: str  # text before the first call (all of it if there is none)
    calls: list[CallSoFar] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        """Every call is whole: what a finished output must be to answer with tool_calls."""
        return bool(self.calls) and all(c.complete and c.name for c in self.calls)


def scan_json(text: str, start: int) -> tuple[int | None, dict[str, tuple[int, int | None]]]:
    """Scan the JSON object starting at `text[start]` ("{"). Returns (end, keys): `end` is one
    past its closing brace (None if the text ends first); `keys` maps each top-level key to its
    value's (start, end) span (end None while unfinished)."""
    depth, i, in_string, escaped = 0, start, False, False
    keys: dict[str, tuple[int, int | None]] = {}
    key_start: int | None = None
    pending_key: str | None = None
    value: tuple[str, int] | None = None  # (key, start) of the top-level value being read
    while i < len(text):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 1 and value is None and key_start is not None:
                    try:
                        pending_key = json.loads(text[key_start : i + 1])
                    except json.JSONDecodeError:
                        pending_key = None
                    key_start = None
        elif ch == '"':
            in_string = True
            if depth == 1 and value is None:
                key_start = i
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                if value is not None:
                    keys[value[0]] = (value[1], _rstrip(text, i))
                return i + 1, keys
        elif ch == ":" and depth == 1 and pending_key is not None:
            j = i + 1
            while j < len(text) and text[j] in " \t\r\n":
                j += 1
            value, pending_key = (pending_key, j), None
            keys[value[0]] = (j, None)
        elif ch == "," and depth == 1 and value is not None:
            keys[value[0]] = (value[1], _rstrip(text, i))
            value = None
        i += 1
    return None, keys


def _rstrip(text: str, end: int) -> int:
    while end > 0 and text[end - 1] in " \t\r\n":
        end -= 1
    return end


def read_call(text: str, start: int, args_key: str) -> tuple[CallSoFar, int | None]:
    """The call object at `text[start]`, and one past its end (None if unfinished)."""
    end, keys = scan_json(text, start)
    call = CallSoFar()
    if "name" in keys and keys["name"][1] is not None:
        name_start, name_end = keys["name"]
        try:
            name = json.loads(text[name_start:name_end])
            call.name = name if isinstance(name, str) else None
        except json.JSONDecodeError:
            pass
    if args_key in keys:
        a_start, a_end = keys[args_key]
        call.arguments = text[a_start : len(text) if a_end is None else a_end]
        if a_end is not None and end is not None:
            try:
                parsed = json.loads(call.arguments)
                if isinstance(parsed, str):  # arguments written as a JSON string
                    call.arguments = parsed
                call.complete = True
            except json.JSONDecodeError:
                pass
    return call, end


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


class ToolParser(ABC):
    """One family's tool-call format. Subclasses set `name` and `args_key`; the registry
    `PARSERS` maps names to them."""

    name: ClassVar[str]
    args_key: ClassVar[str] = "arguments"

    @abstractmethod
    def read(self, text: str) -> ToolText:
        """The content and the calls of `text`, a prefix of (or the whole) output."""

    @abstractmethod
    def grammar(self, call_schema: dict[str, Any], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) for output that is only tool calls, each call
        object matching `call_schema`; more than one only if `parallel`."""

    def call_object(self, name_schema: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        """The JSON schema of one call object of this format."""
        return {
            "type": "object",
            "properties": {"name": name_schema, self.args_key: params},
            "required": ["name", self.args_key],
            "additionalProperties": False,
        }

    def read_calls(self, text: str, i: int, separators: str) -> list[CallSoFar]:
        """Call objects from `text[i]` on, separated by whitespace and `separators`."""
        calls: list[CallSoFar] = []
        while True:
            i = _skip_ws(text, i)
            while i < len(text) and text[i] in separators:
                i = _skip_ws(text, i + 1)
            if i >= len(text) or text[i] != "{":
                return calls
            call, end = read_call(text, i, self.args_key)
            calls.append(call)
            if end is None:
                return calls
            i = end


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def read(self, text: str) -> ToolText:
        first = text.find(self.START)
        if first < 0:
            held = _held_prefix(text, self.START)
            return ToolText(text[: len(text) - held])
        calls: list[CallSoFar] = []
        i = first
        while (i := text.find(self.START, i)) >= 0:
            i += len(self.START)
            found = self.read_calls(text, i, "")
            if not found:
                calls.append(CallSoFar())
                break
            calls.append(found[0])
            close = text.find(self.END, i)
            if close < 0:
                break
            i = close + len(self.END)
        return ToolText(text[:first].rstrip(), calls)

    def grammar(self, call_schema: dict[str, Any], parallel: bool) -> str:
        more = ' ("\\n" call)*' if parallel else ""
        return (
            f"start: call{more}\n"
            f'call: "<tool_call>\\n" obj "\\n</tool_call>"\n'
            f"obj: %json {json.dumps(call_schema)}\n"
        )


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    args_key = "parameters"
    TAG = "<|python_tag|>"

    def read(self, text: str) -> ToolText:
        body = text.removeprefix(self.TAG)
        i = _skip_ws(body, 0)
        if i >= len(body) or body[i] != "{":
            return ToolText(text if not self.TAG.startswith(text) else "")
        return ToolText("", self.read_calls(body, i, ";"))

    def grammar(self, call_schema: dict[str, Any], parallel: bool) -> str:
        more = ' ("; " obj)*' if parallel else ""
        return f"start: obj{more}\nobj: %json {json.dumps(call_schema)}\n"


class MistralParser(ToolParser):
    name = "mistral"
    START = "[TOOL_CALLS]"

    def read(self, text: str) -> ToolText:
        first = text.find(self.START)
        if first < 0:
            return ToolText(text[: len(text) - _held_prefix(text, self.START)])
        i = _skip_ws(text, first + len(self.START))
        if i < len(text) and text[i] == "[":
            i += 1
        return ToolText(text[:first].rstrip(), self.read_calls(text, i, ","))

    def grammar(self, call_schema: dict[str, Any], parallel: bool) -> str:
        array = {"type": "array", "items": call_schema, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        array["x-guidance"] = call_schema.get("x-guidance", {})
        return f'start: "[TOOL_CALLS]" calls\ncalls: %json {json.dumps(array)}\n'


def _held_prefix(text: str, marker: str) -> int:
    """How many trailing characters of `text` could start `marker` (held back from content)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}

# config.json model_type (or Thermostat's family) -> parser; others get hermes
FAMILY_PARSERS = {
    "llama": "llama3_json",
    "mistral": "mistral",
    "mixtral": "mistral",
    "thermostat-demo": "hermes",
}


def parser_for(model_config: dict[str, Any], override: str | None = None) -> ToolParser:
    """The parser named by `override` (--tool-call-parser), else the model family's."""
    if override is not None:
        return PARSERS[override]()
    family = model_config.get("thermostat_family") or model_config.get("model_type") or ""
    return PARSERS[FAMILY_PARSERS.get(family, "hermes")]()
