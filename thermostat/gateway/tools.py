"""The constraint of a forced tool call, as the gateway reports it (`sampling.constraint`).

`serve` constrains a forced call (`tool_choice` required or named) with its tool-call format's
grammar, and reports that grammar's hash. The upstream enforces a forced call its own way, in
its own format (vLLM: a JSON schema of the call list; llama.cpp: a GBNF grammar), which the
gateway cannot see. So the gateway reports what the request constrains the output to:

| field  | value                                                                          |
|--------|--------------------------------------------------------------------------------|
| kind   | `tool_call`                                                                    |
| source | `tool_choice`                                                                  |
| hash   | of the JSON schema of one call object `{name, arguments}` (the forced tool's   |
|        | name as a constant, its parameters closed as serve closes them; `anyOf` for    |
|        | `required` with several tools): the same request, the same hash, any upstream |

`tool_choice` and `tools` are checked as `serve` checks them (a 400 naming the field).
"""

from __future__ import annotations

from typing import Any

from thermostat.api.protocol import ChatCompletionRequest
from thermostat.sampling.structured import StructuredOutput, closed
from thermostat.server.tool_parsers import parser_for
from thermostat.server.tools import ToolRequest


def tool_constraint(body: ChatCompletionRequest) -> StructuredOutput | None:
    """None unless the body forces a tool call; raises ConstraintError naming the field."""
    request = ToolRequest.of(body, parser_for({}))  # its checks; its parser goes unused
    if request is None or not request.forced:
        return None
    calls = []
    for tool in request.tools:
        function = tool["function"]
        if request.choice in ("required", function["name"]):
            params = closed(function.get("parameters") or {"type": "object"})
            calls.append(_call_object(function["name"], params))
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return StructuredOutput.json_schema(schema, "tool_choice", kind="tool_call")


def _call_object(name: str, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
