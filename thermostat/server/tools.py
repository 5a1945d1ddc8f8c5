"""Tool calling on /v1/chat/completions: what a request's `tools` and `tool_choice` mean for
its prompt, its constraint and its answer.

The template always sees the tools.

| tool_choice       | output constraint                             | answer                  |
|-------------------|-----------------------------------------------|-------------------------|
| `none`            | none                                          | text                    |
| `auto` (default)  | none                                          | text and/or tool_calls  |
| `required`        | a call of any tool (more if parallel)         | tool_calls              |
| `{"function": …}` | one call of that tool                         | tool_calls              |

The constraint is the parser's grammar (server/tool_parsers.py) around a JSON schema of the
call object (the tool's name as a constant, its parameters' schema closed: no keys it does not
list unless it allows them, sampling/structured.py's `closed`), with JSON whitespace bounded as
for response_format. A choice whose output holds whole calls finishes with
`finish_reason: "tool_calls"`; each call gets an id `call_<24 hex>`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from thermostat.api.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from thermostat.sampling.structured import (
    JSON_OPTIONS,
    ConstraintError,
    StructuredOutput,
    closed,
)
from thermostat.server.tool_parsers import ToolParser, ToolText


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
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    @property
    def parses(self) -> bool:
        """Whether the output is read for tool calls."""
        return self.choice != "none"

    def constraint(self) -> StructuredOutput | None:
        """The grammar of a forced call; None when the model may answer in text."""
        if not self.forced:
            return None
        calls = []
        for tool in self.tools:
            function = tool["function"]
            if self.choice in ("required", function["name"]):
                params = closed(function.get("parameters") or {"type": "object"})
                calls.append(self.parser.call_object({"const": function["name"]}, params))
        schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = schema | {"x-guidance": dict(JSON_OPTIONS)}
        grammar = self.parser.grammar(schema, self.parallel and self.choice == "required")
        return StructuredOutput.lark(grammar, "tool_choice", kind="tool_call")


def tool_calls(read: ToolText) -> list[ToolCall]:
    return [
        ToolCall(id=call_id(), function=FunctionCall(name=c.name or "", arguments=c.arguments))
        for c in read.calls
    ]


@dataclass
class ToolStream:
    """One streamed choice: text in, OpenAI deltas out (content, then per call a first delta
    with id, type and name, then pieces of its arguments)."""

    parser: ToolParser
    text: str = ""
    content_sent: int = 0
    args_sent: list[int] = field(default_factory=list)  # per call announced so far

    def feed(self, new_text: str) -> DeltaMessage | None:
        self.text += new_text
        read = self.parser.read(self.text)
        delta = DeltaMessage()
        if len(read.content) > self.content_sent:
            delta.content = read.content[self.content_sent :]
            self.content_sent = len(read.content)
        pieces = []
        for index, call in enumerate(read.calls):
            if index == len(self.args_sent) and call.name:
                self.args_sent.append(0)
                pieces.append(
                    DeltaToolCall(
                        index=index,
                        id=call_id(),
                        type="function",
                        function=DeltaFunctionCall(name=call.name, arguments=""),
                    )
                )
            if index < len(self.args_sent) and len(call.arguments) > self.args_sent[index]:
                piece = call.arguments[self.args_sent[index] :]
                self.args_sent[index] = len(call.arguments)
                args = DeltaFunctionCall(arguments=piece)
                pieces.append(DeltaToolCall(index=index, function=args))
        if pieces:
            delta.tool_calls = pieces
        return delta if delta.content is not None or pieces else None

    @property
    def called(self) -> bool:
        return bool(self.args_sent)
