"""The constraint of a forced tool call, as the gateway reports it (`sampling.constraint`).

`serve` constrains a forced call (`tool_choice` required or named) with its tool-call format's
grammar. The upstream enforces a forced call its own way, in its own format (vLLM: a JSON
schema of the call list; llama.cpp: a GBNF grammar), which the gateway cannot see. The report
is serve's (server/tools.py `ToolRequest.constraint`): kind `tool_call`, source `tool_choice`,
and the hash of the call object's schema in OpenAI's terms, which no format changes: the same
request, the same hash, through the gateway or direct, any upstream.

`tool_choice` and `tools` are checked as `serve` checks them (a 400 naming the field).
"""

from __future__ import annotations

from thermostat.api.protocol import ChatCompletionRequest
from thermostat.api.tool_parsers import parser_for
from thermostat.api.tools import ToolRequest
from thermostat.sampling.structured import StructuredOutput


def tool_constraint(body: ChatCompletionRequest) -> StructuredOutput | None:
    """None unless the body forces a tool call; raises ConstraintError naming the field."""
    request = ToolRequest.of(body, parser_for({}))  # its grammar goes unused, its hash not
    return request.constraint() if request is not None else None
