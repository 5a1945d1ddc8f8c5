"""What every tool-call format shares (tool_parsers.py's table lists them): the read of an
output (`ToolText`), the tokenizer's marker tokens, and the parser's base class, which reads by
prefix and writes a forced call's grammar (tool_parsers.py's docstring tells how)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from thermostat.api.lark_string import LarkStringError, in_json_string
from thermostat.api.tool_json import CallSoFar, read_call, skip_ws

# A freeform tool (the Responses API's `custom`) is a function of one string argument
# (FREEFORM_INPUT); its schema may carry the Lark grammar of that string under FREEFORM_GRAMMAR.
FREEFORM_INPUT = "input"
FREEFORM_GRAMMAR = "x-thermostat-lark"


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
            rules.append(f"call{k}: {self.call_rule(name, f'args{k}')}")
            rules.append(args_rule(f"args{k}", params))
        return "\n".join(rules) + "\n"

    def call_rule(self, name: str, args: str) -> str:
        """The Lark rule of one call of `name` around the rule `args` (its arguments): here the
        call object, fixed up to its arguments."""
        head = f'{{"name": {json.dumps(name)}, "{self.args_key}": '
        return f'{json.dumps(head)} {args} "}}"'

    def lit(self, marker: str) -> str:
        """A marker in a Lark grammar: its token where it is one added token, else its text."""
        token = self.tokens.get(marker)
        return f"<[{token.id}]>" if token is not None else json.dumps(marker)


def args_rule(rule: str, params: Mapping[str, Any]) -> str:
    """The Lark rule of a call's JSON arguments: to their schema, or for a freeform tool whose
    schema carries its input's grammar (`FREEFORM_GRAMMAR`), `{"input": "..."}` with the string
    to that grammar (lark_string.py); a grammar the rewrite cannot take leaves the string free."""
    grammar = params.get(FREEFORM_GRAMMAR)
    schema = {k: v for k, v in params.items() if k != FREEFORM_GRAMMAR}
    if isinstance(grammar, str):
        try:
            rules, start = in_json_string(grammar, f"{rule}_")
        except LarkStringError:
            pass
        else:
            head, tail = json.dumps(f'{{"{FREEFORM_INPUT}": "'), json.dumps('"}')
            return f"{rule}: {head} {start} {tail}\n{rules}"
    return f"{rule}: %json {json.dumps(schema)}"


def split_at(text: str, marker: str) -> tuple[str, int | None]:
    """The content before `marker`, and where the marker begins (None while it is absent: then
    a tail of `text` that could start it is held back from the content)."""
    first = text.find(marker)
    if first >= 0:
        return text[:first].rstrip(), first
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return text[:-n].rstrip(), None
    return text.rstrip(), None
