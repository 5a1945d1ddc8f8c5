"""Tool calls in generated text: the formats model families emit, read back into OpenAI's
`tool_calls`, and written as the grammar that forces a call (`tool_choice` required or named).

| parser        | families           | a call as the model writes it                             |
|---------------|--------------------|-----------------------------------------------------------|
| `hermes`      | Qwen, Hermes, demo | `<tool_call>{"name": N, "arguments": {...}}</tool_call>`  |
| `llama3_json` | Llama 3            | `{"name": N, "parameters": {...}}` (calls joined by `; `) |
| `mistral`     | Mistral, Mixtral   | `[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]`      |
| `deepseek_v3` | DeepSeek V3, R1    | `B function S N\\n```json\\n{...}\\n```E` (B, S, E below)  |
| `deepseek_v31`| DeepSeek V3.1      | `B N S {...} E`                                           |
| `deepseek_v32`| DeepSeek V3.2      | DSML tags, a tag per parameter (tool_dsml.py)             |
| `deepseek_v4` | DeepSeek V4        | the same, in a `tool_calls` block                         |

(hermes writes a newline after `<tool_call>` and before `</tool_call>`; B, S, E: DeepSeek's
`<｜tool▁call▁begin｜>`, `<｜tool▁sep｜>`, `<｜tool▁call▁end｜>`, its formats in full in
tool_parsers_deepseek.py and tool_dsml.py.) A model's parser is its config's family's
(`FAMILY_PARSERS`, by model_type, else by architecture), a DeepSeek one's as its chat template
writes calls; the classes share tool_base.py.

Reading is by prefix (`ToolParser.read`): the text so far gives the content before the first
call and, per call, its name once complete and the raw text of its arguments so far. A read
can resume from an earlier read of a prefix: the calls that prefix had closed stay as read and
reading picks up past them, so a stream reads each token's text from its last closed call on.
Arguments are the model's own JSON text (what OpenAI's `function.arguments` string carries).

The grammar of a forced call writes the format's envelope as fixed text (markers, the name, the
arguments key: `<tool_call>\\n{"name": "f", "arguments": ` and `}\\n</tool_call>`); only the
arguments are generated, to the tool's schema (as xgrammar's structural tags do). A marker that
is one added token of the tokenizer (`<tool_call>` in Qwen's, `[TOOL_CALLS]` in Mistral's) is
written as that token (`<[id]>`): llguidance reads every added token as a special token, never
as its text, so a grammar that spelled it out could neither take the token nor be written
without it (the tokenizer always produces it). The text keeps special tokens then (`keeps_special`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from thermostat.api.tool_base import MarkerToken, ToolParser, ToolText, marker_tokens, split_at
from thermostat.api.tool_dsml import DeepSeekV4Parser, DeepSeekV32Parser
from thermostat.api.tool_json import CallSoFar, skip_ws
from thermostat.api.tool_parsers_deepseek import (
    DEEPSEEK_ARCHITECTURES,
    DEEPSEEK_FAMILIES,
    DeepSeekV3Parser,
    DeepSeekV31Parser,
    deepseek_parser,
)

__all__ = [  # the base's names, re-exported
    "FAMILY_PARSERS",
    "PARSERS",
    "MarkerToken",
    "ToolParser",
    "ToolText",
    "marker_tokens",
    "parser_for",
]


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    markers = (START, END)

    def start(self, text: str) -> tuple[str, int | None]:
        return split_at(text, self.START)

    def calls_from(self, text: str, i: int) -> tuple[list[CallSoFar], int, int]:
        calls: list[CallSoFar] = []
        resume = i
        while (i := text.find(self.START, i)) >= 0:
            i += len(self.START)
            close = text.find(self.END, i)
            found = super().calls_from(text if close < 0 else text[:close], i)[0]
            calls.append(found[0] if found else CallSoFar())
            if close < 0:
                return calls, resume, len(calls) - 1
            i = resume = close + len(self.END)
        return calls, resume, len(calls)

    def frame(self, call: str, parallel: bool) -> str:
        more = ' ("\\n" tool_call)*' if parallel else ""
        start, end = self.lit(self.START), self.lit(self.END)
        return f'start: tool_call{more}\ntool_call: {start} "\\n" ({call}) "\\n" {end}'


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    args_key = "parameters"
    separators = ";"
    TAG = "<|python_tag|>"  # read if present; the grammar writes none

    def start(self, text: str) -> tuple[str, int | None]:
        body = text.removeprefix(self.TAG)
        i = skip_ws(body, 0)
        if i < len(body) and body[i] == "{":
            return "", len(text) - len(body) + i
        if i == len(body) or self.TAG.startswith(text):
            return "", None  # nothing but whitespace (or a tag) yet
        return text.rstrip(), None

    def frame(self, call: str, parallel: bool) -> str:
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\ncall: {call}"


class MistralParser(ToolParser):
    name = "mistral"
    separators = ","
    START = "[TOOL_CALLS]"
    markers = (START,)

    def start(self, text: str) -> tuple[str, int | None]:
        content, first = split_at(text, self.START)
        if first is None or (i := skip_ws(text, first + len(self.START))) >= len(text):
            return content, None
        return content, i + (text[i] == "[")

    def frame(self, call: str, parallel: bool) -> str:
        more = ' (", " call)*' if parallel else ""
        return f'start: {self.lit(self.START)} "[" call{more} "]"\ncall: {call}'


FORMATS: tuple[type[ToolParser], ...] = (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    DeepSeekV3Parser,
    DeepSeekV31Parser,
    DeepSeekV32Parser,
    DeepSeekV4Parser,
)
PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in FORMATS}

# config.json model_type (or Thermostat's family) -> parser; others get hermes
FAMILY_PARSERS = {
    "llama": "llama3_json",
    "mistral": "mistral",
    "mixtral": "mistral",
    "thermostat-demo": "hermes",
    **DEEPSEEK_FAMILIES,  # the chat template may say otherwise (tool_parsers_deepseek.py)
}


def parser_for(
    model_config: dict[str, Any],
    override: str | None = None,
    tokens: Mapping[str, MarkerToken] | None = None,
    template: str | Mapping[str, str] | None = None,
) -> ToolParser:
    """The parser named by `override` (--tool-call-parser), else the model family's (by
    model_type, else by architecture); `tokens`: the tokenizer's added tokens
    (`marker_tokens`); `template`: its chat template (or named templates), which tells
    DeepSeek's formats apart."""
    if override is not None:
        return PARSERS[override](tokens)
    architectures = model_config.get("architectures") or [""]
    family = (
        model_config.get("thermostat_family")
        or model_config.get("model_type")
        or DEEPSEEK_ARCHITECTURES.get(architectures[0], "")
    )
    name = FAMILY_PARSERS.get(family, "hermes")
    if family in DEEPSEEK_FAMILIES:
        text = (
            template
            if template is None or isinstance(template, str)
            else "\n".join(template.values())
        )
        name = deepseek_parser(name, text)
    return PARSERS[name](tokens)
