"""Tool calls in generated text: the formats model families emit, read back into OpenAI's
`tool_calls`, and written as the grammar that forces a call (`tool_choice` required or named).

| parser        | families           | a call as the model writes it                             |
|---------------|--------------------|-----------------------------------------------------------|
| `hermes`      | Qwen, Hermes, demo | `<tool_call>{"name": N, "arguments": {...}}</tool_call>`  |
| `llama3_json` | Llama 3            | `{"name": N, "parameters": {...}}` (calls joined by `; `) |
| `mistral`     | Mistral, Mixtral   | `[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]`      |

(hermes writes a newline after `<tool_call>` and before `</tool_call>`.)

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

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from thermostat.api.tool_json import CallSoFar, read_call, skip_ws


@dataclass
class ToolText:
    """A (possibly partial) output read by a parser."""

    content: str  # text before the first call (all of it, trailing whitespace held, if none)
    calls: list[CallSoFar] = field(default_factory=list)
    resume: int | None = None  # where reading a longer text picks up (None: from the start)
    settled: int = 0  # calls[:settled] are closed: a longer text reads them the same

    @property
    def valid(self) -> bool:
        """Every call is whole: what a finished output must be to end with "tool_calls"."""
        return bool(self.calls) and all(c.complete and c.name for c in self.calls)

    @property
    def named(self) -> list[CallSoFar]:
        """The calls whose name was read: those an answer carries (and a stream announces)."""
        return [c for c in self.calls if c.name]


@dataclass(frozen=True)
class MarkerToken:
    """A format's marker that is one added token of the tokenizer."""

    id: int
    special: bool  # decoding with skip_special_tokens drops it


def marker_tokens(added: Mapping[int, Any]) -> dict[str, MarkerToken]:
    """The added tokens of a tokenizer by text, from transformers' `added_tokens_decoder`
    (id -> AddedToken with `content` and `special`)."""
    return {t.content: MarkerToken(i, bool(t.special)) for i, t in added.items()}


class ToolParser(ABC):
    """One family's tool-call format. Subclasses set `name`, `args_key`, `separators` and
    `markers`; the registry `PARSERS` maps names to them. `tokens`: the tokenizer's added
    tokens by text."""

    name: ClassVar[str]
    args_key: ClassVar[str] = "arguments"
    separators: ClassVar[str] = ""  # between two call objects, besides whitespace
    markers: ClassVar[tuple[str, ...]] = ()  # the fixed texts its grammar writes

    def __init__(self, tokens: Mapping[str, MarkerToken] | None = None) -> None:
        self.tokens = {m: t for m, t in (tokens or {}).items() if m in self.markers}

    @property
    def keeps_special(self) -> bool:
        """Whether the output must be decoded with special tokens: a marker is one."""
        return any(t.special for t in self.tokens.values())

    def read(self, text: str, after: ToolText | None = None) -> ToolText:
        """The content and the calls of `text`, a prefix of (or the whole) output. `after`: a
        read of a prefix of `text`, to resume from."""
        if after is not None and after.resume is not None:
            content, i, done = after.content, after.resume, after.calls[: after.settled]
        else:
            content, start = self.start(text)
            if start is None:
                return ToolText(content)
            i, done = start, []
        calls, resume, settled = self.calls_from(text, i)
        return ToolText(content, done + calls, resume, len(done) + settled)

    @abstractmethod
    def start(self, text: str) -> tuple[str, int | None]:
        """The content, and where the calls begin (None while no call has begun)."""

    def calls_from(self, text: str, i: int) -> tuple[list[CallSoFar], int, int]:
        """The calls from `text[i]` on (where a call may begin), the offset past the last
        closed one (`i` if none) and how many are closed. Here: call objects separated by
        whitespace and `separators`."""
        calls: list[CallSoFar] = []
        resume = i
        while True:
            i = skip_ws(text, i)
            while i < len(text) and text[i] in self.separators:
                i = skip_ws(text, i + 1)
            if i >= len(text) or text[i] != "{":
                return calls, resume, len(calls)
            call, end = read_call(text, i, self.args_key)
            if end is None:
                return [*calls, call], resume, len(calls)
            calls.append(call)
            i = resume = end

    @abstractmethod
    def frame(self, call: str, parallel: bool) -> str:
        """The Lark rule `start` around the rule `call` (one call object)."""

    def grammar(self, calls: Mapping[str, dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) for output that is only tool calls: `calls`
        maps each tool that may be called to its arguments' JSON schema; more than one call
        only if `parallel`. The call object's text is fixed up to its arguments."""
        rules = [self.frame(" | ".join(f"call{k}" for k in range(len(calls))), parallel)]
        for k, (name, params) in enumerate(calls.items()):
            head = f'{{"name": {json.dumps(name)}, "{self.args_key}": '
            rules.append(f'call{k}: {json.dumps(head)} args{k} "}}"')
            rules.append(f"args{k}: %json {json.dumps(params)}")
        return "\n".join(rules) + "\n"

    def lit(self, marker: str) -> str:
        """A marker in a Lark grammar: its token where it is one added token, else its text."""
        token = self.tokens.get(marker)
        return f"<[{token.id}]>" if token is not None else json.dumps(marker)


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    markers = (START, END)

    def start(self, text: str) -> tuple[str, int | None]:
        return _split(text, self.START)

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
        content, first = _split(text, self.START)
        if first is None or (i := skip_ws(text, first + len(self.START))) >= len(text):
            return content, None
        return content, i + (text[i] == "[")

    def frame(self, call: str, parallel: bool) -> str:
        more = ' (", " call)*' if parallel else ""
        return f'start: {self.lit(self.START)} "[" call{more} "]"\ncall: {call}'


def _split(text: str, marker: str) -> tuple[str, int | None]:
    """The content before `marker`, and where the marker begins (None while it is absent: then
    a tail of `text` that could start it is held back from the content)."""
    first = text.find(marker)
    if first >= 0:
        return text[:first].rstrip(), first
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return text[:-n].rstrip(), None
    return text.rstrip(), None


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


def parser_for(
    model_config: dict[str, Any],
    override: str | None = None,
    tokens: Mapping[str, MarkerToken] | None = None,
) -> ToolParser:
    """The parser named by `override` (--tool-call-parser), else the model family's; `tokens`:
    the tokenizer's added tokens (`marker_tokens`)."""
    if override is not None:
        return PARSERS[override](tokens)
    family = model_config.get("thermostat_family") or model_config.get("model_type") or ""
    return PARSERS[FAMILY_PARSERS.get(family, "hermes")](tokens)
