"""Tool calling on /v1/chat/completions: what a request's `tools` and `tool_choice` mean for
its prompt, its constraint and its answer.

The template always sees the tools.

| tool_choice       | output constraint                             | answer                  |
|-------------------|-----------------------------------------------|-------------------------|
| `none`            | none                                          | text                    |
| `auto` (default)  | none                                          | text and/or tool_calls  |
| `required`        | a call of any tool (more if parallel)         | tool_calls              |
| `{"function": …}` | one call of that tool                         | tool_calls              |

The constraint is the parser's grammar (server/tool_parsers.py): the format's envelope as fixed
text around each forced tool's arguments, generated to its parameters' schema closed (no keys
it does not list unless it allows them, sampling/structured.py's `closed`), with JSON
whitespace bounded as for response_format. Its hash (`sampling.constraint.hash`) is of the
call object's schema in OpenAI's terms (`call_schema`), the same for any format, so the
gateway reports the same one.

One rule for streamed and whole answers (`answer`, `finish_reason`): a choice answers with the
calls whose name was read (a stream has announced them), else with its text; it ends in
`finish_reason: "tool_calls"` where it stopped with every call whole (a call cut by
`max_tokens` ends in "length", with what was read of it). Each call gets an id
`call_<24 hex>`.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from thermostat.api.protocol import (
    ChatCompletionRequest,
    ChatMessageOut,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from thermostat.api.request_params import to_sampling_params
from thermostat.api.tool_base import FREEFORM_GRAMMAR
from thermostat.api.tool_parsers import ToolParser, ToolText, parser_for
from thermostat.sampling.params import SamplingParams
from thermostat.sampling.structured import (
    ConstraintError,
    StructuredOutput,
    canonical,
    closed,
)

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in the stubs only

# A call's arguments are one line, as the families write them: at most a space between two
# tokens of the JSON text (`{"city": "Paris", "unit": "C"}`); no budget goes to indentation.
ARGS_JSON: JsonCompileOptions = {"whitespace_flexible": False, "whitespace_pattern": "[ ]?"}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools as served: the template's view, the forced-call constraint."""

    parser: ToolParser
    tools: list[dict[Any, Any]]  # OpenAI's form, as transformers' apply_chat_template takes it
    choice: str  # none | auto | required | the named function
    parallel: bool

    @classmethod
    def of(cls, body: ChatCompletionRequest, parser: ToolParser) -> ToolRequest | None:
        """None without tools; raises ConstraintError naming the field for a choice that
        names no tool or tools given twice."""
        choice_field = body.tool_choice
        if not body.tools:
            if choice_field not in (None, "none", "auto"):
                raise ConstraintError("tool_choice", "tool_choice: requires tools")
            return None
        names = [t.function.name for t in body.tools]
        if len(set(names)) != len(names):
            raise ConstraintError("tools", "tools: function names must be unique")
        choice: str
        if choice_field is None or isinstance(choice_field, str):
            choice = choice_field or "auto"
        else:
            choice = choice_field.function.name
            if choice not in names:
                raise ConstraintError(
                    "tool_choice", f"tool_choice: {choice!r} is not one of the tools"
                )
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
        parallel = body.parallel_tool_calls is not False
        return cls(parser, tools, choice, parallel)

    @property
    def shown(self) -> list[dict[Any, Any]]:
        """The tools as the chat template shows them (a freeform tool's grammar is in its
        description, not its schema)."""
        return [shown_tool(t) for t in self.tools]

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    @property
    def parses(self) -> bool:
        """Whether the output is read for tool calls."""
        return self.choice != "none"

    def call_schema(self) -> dict[str, Any]:
        """The JSON schema of one forced call object, in OpenAI's terms: `name` the tool's
        name as a constant, `arguments` its parameters closed; `anyOf` over the tools that
        `required` allows. Its hash is the constraint's, whatever the format (serve's parser,
        or the gateway's upstream)."""
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, params in self._forced().items()
        ]
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    def constraint(self) -> StructuredOutput | None:
        """The grammar of a forced call; None when the model may answer in text."""
        if not self.forced:
            return None
        calls = {name: p | {"x-guidance": dict(ARGS_JSON)} for name, p in self._forced().items()}
        grammar = self.parser.grammar(calls, self.parallel and self.choice == "required")
        source = canonical(self.call_schema())
        return StructuredOutput.lark(grammar, "tool_choice", kind="tool_call", source=source)

    def params(self, body: ChatCompletionRequest) -> SamplingParams:
        """The body's SamplingParams as served: a forced call one of its constraints, the text
        decoded with special tokens where the format's markers are special tokens (unless the
        client said otherwise), so that they can be read."""
        params = to_sampling_params(body, self.constraint())
        if self.parses and self.parser.keeps_special and params.skip_special_tokens is None:
            params = dataclasses.replace(params, skip_special_tokens=False)
        return params

    def _forced(self) -> dict[str, dict[str, Any]]:
        """The tools a forced call may be of, by name: their parameters' schemas, closed."""
        return {
            t["function"]["name"]: closed(t["function"].get("parameters") or {"type": "object"})
            for t in self.tools
            if self.choice in ("required", t["function"]["name"])
        }


def shown_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as the template shows it: a freeform tool's grammar is in its description."""
    params = tool["function"].get("parameters")
    if not isinstance(params, dict) or FREEFORM_GRAMMAR not in params:
        return tool
    shown = {k: v for k, v in params.items() if k != FREEFORM_GRAMMAR}
    return tool | {"function": tool["function"] | {"parameters": shown}}


def tool_constraint(body: ChatCompletionRequest) -> StructuredOutput | None:
    """The gateway's report of a forced call (the upstream enforces it in its own format, which
    the gateway cannot see): serve's kind, source and hash, which no parser changes. None unless
    the body forces a call; raises ConstraintError naming the field, as serve does."""
    request = ToolRequest.of(body, parser_for({}))  # its grammar goes unused, its hash not
    return request.constraint() if request is not None else None


def answer(text: str, read: ToolText | None) -> ChatMessageOut:
    """A finished choice's message, streamed or whole: its calls once one has a name (a stream
    has announced it then), after the content before them; else its text."""
    if read is None or not read.named:
        return ChatMessageOut(content=text)
    calls = [
        ToolCall(id=call_id(), function=FunctionCall(name=c.name or "", arguments=c.arguments))
        for c in read.named
    ]
    return ChatMessageOut(content=read.content or None, tool_calls=calls)


def finish_reason(end: str, read: ToolText | None) -> str:
    """The one rule: a choice that stopped (not cut) with every call whole ends in
    "tool_calls"."""
    return "tool_calls" if end == "stop" and read is not None and read.valid else end


@dataclass
class ToolStream:
    """One streamed choice: text in, OpenAI deltas out (content, then per named call a first
    delta with id, type and name, then pieces of its arguments). Each token's text is read from
    the last closed call on; the deltas join to `answer`'s message."""

    parser: ToolParser
    text: str = ""
    read: ToolText = field(default_factory=lambda: ToolText(""))
    content_sent: int = 0
    args_sent: list[int] = field(default_factory=list)  # per call announced so far

    def feed(self, new_text: str, finished: bool = False) -> DeltaMessage | None:
        """The delta of `new_text`; `finished`: it is the last (text no call took is sent)."""
        self.text += new_text
        self.read = self.parser.read(self.text, self.read)
        named = self.read.named
        content = self.text if finished and not named else self.read.content
        delta = DeltaMessage()
        if len(content) > self.content_sent:
            delta.content = content[self.content_sent :]
            self.content_sent = len(content)
        pieces = []
        for index, call in enumerate(named):
            if index == len(self.args_sent):
                self.args_sent.append(0)
                head = DeltaFunctionCall(name=call.name, arguments="")
                pieces.append(
                    DeltaToolCall(index=index, id=call_id(), type="function", function=head)
                )
            if len(call.arguments) > self.args_sent[index]:
                piece = call.arguments[self.args_sent[index] :]
                self.args_sent[index] = len(call.arguments)
                args = DeltaFunctionCall(arguments=piece)
                pieces.append(DeltaToolCall(index=index, function=args))
        if pieces:
            delta.tool_calls = pieces
        return delta if delta.content is not None or pieces else None
