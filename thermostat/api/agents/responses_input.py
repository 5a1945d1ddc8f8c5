"""A Responses API body as the chat completions body `serve` and the gateway already serve.

| Responses                               | chat completions                                  |
|-----------------------------------------|---------------------------------------------------|
| `instructions`, leading system/developer| one leading `system` message (joined by a blank line)|
| later system/developer messages         | `system` messages in place                        |
| `input_text` / `output_text` parts      | a message's text                                  |
| `function_call` (+ `custom_tool_call`)  | an assistant message's `tool_calls`               |
| `function_call_output` (+ custom's)     | a `tool` message                                  |
| `reasoning` and hosted tools' items     | left out (accepted)                               |
| `function` tools, `namespace` groups    | function tools (a group's flattened; `strict`:    |
|                                         | as sent, else true, as OpenAI's default)         |
| `custom` tools (freeform, e.g. a Lark grammar) | a function with one string argument `input`|
| other tools (`web_search`, ...)         | left out of the prompt, named in `tools_left_out` |
| `text.format` json_schema / json_object | `response_format`                                 |
| `max_output_tokens`                     | `max_tokens` (cut to the prompt's room, adjusted) |
| `previous_response_id`                  | the stored conversation, before `input`           |

Any other sampling field of the chat body (top_k, min_p, seed, ...) is passed as it is, as
vLLM's extra fields are. A field left out stays out: nothing here supplies a default.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from thermostat.api.agents.content import (
    custom_tool_function,
    invalid,
    parts_text,
    passed_fields,
    string_field,
    validated,
)
from thermostat.api.protocol import ChatCompletionRequest

TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# items of a conversation that carry nothing the model reads again (hosted tools' calls, the
# model's own reasoning, whose encrypted content no other server can read)
SKIPPED_ITEMS = frozenset(
    {
        "reasoning",
        "web_search_call",
        "file_search_call",
        "image_generation_call",
        "code_interpreter_call",
        "tool_search_call",
        "tool_search_output",
        "compaction",
    }
)
ROLES = ("system", "developer", "user", "assistant")
# fields of the Responses body that map onto chat's under another name or shape
MAPPED = {"max_output_tokens", "temperature", "top_p", "text", "tools", "tool_choice"}


class ResponsesRequest(BaseModel):
    """The fields read here; others (service_tier, truncation, client_metadata, ...) are
    accepted and ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = None
    stream: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


@dataclass
class ResponsesPlan:
    """What the answer's translation needs to know of the request."""

    body: ResponsesRequest
    chat: ChatCompletionRequest
    custom_tools: set[str] = field(default_factory=set)  # answered as custom_tool_call items
    left_out: list[str] = field(default_factory=list)  # tool types not in the prompt
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation, w/o system


def parse_body(raw: Any) -> ResponsesRequest:
    return validated(ResponsesRequest, raw)


def to_chat(
    body: ResponsesRequest, raw: Mapping[str, Any], history: list[dict[str, Any]] | None = None
) -> ResponsesPlan:
    """The chat body of a Responses body; `history`: the conversation stored with
    `previous_response_id` (its messages, the answer last). Raises APIError 400 naming the
    item or tool at fault."""
    if body.input is None:
        raise invalid("input", "is required")
    items = (
        [{"type": "message", "role": "user", "content": body.input}]
        if isinstance(body.input, str)
        else body.input
    )
    if not items and not history:
        raise invalid("input", "must not be empty")
    conversation = [*(history or []), *input_messages(items)]
    system, rest = _leading_system(conversation)
    if body.instructions:
        system.insert(0, body.instructions)
    messages = ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest
    tools, custom, left_out = chat_tools(body.tools or [])
    chat: dict[str, Any] = passed_fields(raw, MAPPED)
    chat |= {
        "model": body.model,
        "messages": messages,
        "stream": body.stream,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "user": body.user,
    }
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if tools:
        chat["tools"] = tools
        chat["parallel_tool_calls"] = body.parallel_tool_calls
        chat["tool_choice"] = _tool_choice(body.tool_choice, tools)
    elif body.tool_choice not in (None, "auto", "none"):
        raise invalid("tool_choice", "requires tools this server can run")
    chat["response_format"] = _response_format(body.text)
    request = validated(ChatCompletionRequest, chat)
    return ResponsesPlan(body, request, custom, left_out, conversation)


def input_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of Responses input items, in order; consecutive calls join one assistant
    message (after its text, if the item before was one)."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise invalid(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
            text = parts_text(item.get("content"), f"{where}.content", TEXT_PARTS)
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            call = _call(item, where, kind)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = string_field(item, "call_id", where)
            output = item.get("output")
            text = parts_text(output, f"{where}.output", TEXT_PARTS)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind in SKIPPED_ITEMS:
            continue
        else:
            raise invalid(f"{where}.type", f"{kind!r} is not an input item this server reads")
    return messages


def _call(item: Mapping[str, Any], where: str, kind: str) -> dict[str, Any]:
    name = string_field(item, "name", where)
    call_id = string_field(item, "call_id", where)
    if kind == "custom_tool_call":
        arguments = json.dumps({"input": string_field(item, "input", where)})
    else:
        arguments = string_field(item, "arguments", where)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _leading_system(messages: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """The system texts before the first other message, and the messages after them."""
    i = 0
    while i < len(messages) and messages[i]["role"] == "system":
        i += 1
    return [m["content"] for m in messages[:i]], messages[i:]


def chat_tools(tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], set[str], list[str]]:
    """(chat tools, the names of custom tools among them, the types left out)."""
    out: list[dict[str, Any]] = []
    custom: set[str] = set()
    left_out: list[str] = []

    def add(tool: Mapping[str, Any], where: str) -> None:
        kind = tool.get("type")
        if kind == "function":
            name = string_field(tool, "name", where)
            function = {"name": name, "parameters": tool.get("parameters")}
            if isinstance(tool.get("description"), str):
                function["description"] = tool["description"]
            # OpenAI's default for a Responses function tool is strict; vLLM pins a forced
            # call's arguments to the schema only for a strict tool
            strict = tool.get("strict", True)
            function["strict"] = strict if isinstance(strict, bool) else True
            out.append({"type": "function", "function": function})
        elif kind == "custom":
            name = string_field(tool, "name", where)
            fmt = tool.get("format")
            grammar = fmt.get("definition") if isinstance(fmt, Mapping) else None
            description = tool.get("description")
            out.append(custom_tool_function(name, description, grammar))
            custom.add(name)
        elif kind == "namespace":
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise invalid(f"{where}.tools", "must be a list of tools")
            for j, sub in enumerate(inner):
                add(sub, f"{where}.tools[{j}]")
        elif isinstance(kind, str):
            left_out.append(kind)
        else:
            raise invalid(f"{where}.type", "must be a string")

    for i, tool in enumerate(tools):
        add(tool, f"tools[{i}]")
    return out, custom, left_out


def _tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]]) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind in ("function", "custom"):
        return {
            "type": "function",
            "function": {"name": string_field(choice, "name", "tool_choice")},
        }
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        allowed = {t.get("name") for t in choice.get("tools") or [] if isinstance(t, Mapping)}
        tools[:] = [t for t in tools if t["function"]["name"] in allowed]
        return mode
    raise invalid("tool_choice", f"a tool of type {kind!r} cannot be forced here")


def _response_format(text: Mapping[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise invalid("text.format", "must be an object")
    kind = fmt.get("type")
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    if kind in ("json_object", "text"):
        return {"type": kind}
    raise invalid("text.format.type", f"must be text, json_object or json_schema, got {kind!r}")
