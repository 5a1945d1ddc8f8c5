"""An Anthropic Messages body as the chat completions body `serve` and the gateway serve.

| Messages                                    | chat completions                              |
|---------------------------------------------|-----------------------------------------------|
| `system` (a string or text blocks)          | one leading `system` message                  |
| a system block `x-anthropic-billing-header:`| left out (1)                                  |
| `role: "system"` messages inside `messages` | `system` messages in place                    |
| `text` blocks                               | a message's text                              |
| `tool_use` blocks                           | an assistant message's `tool_calls`           |
| `tool_result` blocks (`is_error` noted)     | `tool` messages, before the turn's text       |
| `thinking` / `redacted_thinking` blocks     | left out (accepted)                           |
| `image` / `document` blocks                 | refused: 400 naming the block                 |
| `tools` with `input_schema` (and `strict`)  | function tools; server tools left out, named  |
| `tool_choice` auto / any / tool / none      | auto / required / the named function / none   |
| `disable_parallel_tool_use`                 | `parallel_tool_calls: false`                  |
| `stop_sequences`, `top_k`, `max_tokens`     | `stop`, `top_k`, `max_tokens` (cut to room)   |
| `output_config.format` json_schema          | `response_format`                             |

(1) Claude Code's billing line changes per conversation: kept, it would defeat the prefix cache.
`thinking`, `context_management`, `metadata`, `cache_control` and the like are accepted and
ignored. Any other sampling field of the chat body (seed, min_p, ...) is passed as it is. A
field left out stays out; `max_tokens` is required, as Anthropic's API requires it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from thermostat.api.agents.content import (
    invalid,
    parts_text,
    passed_fields,
    string_field,
    validated,
)
from thermostat.api.protocol import ChatCompletionRequest

BILLING_HEADER = "x-anthropic-billing-header:"
SKIPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})
TEXT_BLOCKS = ("text",)
CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# fields of the Messages body that map onto chat's under another name or shape
MAPPED = {"max_tokens", "temperature", "top_p", "top_k", "stop", "tools", "tool_choice"}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


@dataclass
class MessagesPlan:
    body: MessagesRequest
    chat: ChatCompletionRequest
    left_out: list[str] = field(default_factory=list)  # tools not in the prompt, by name


def parse_body(raw: Any) -> MessagesRequest:
    return validated(MessagesRequest, raw)


def to_chat(body: MessagesRequest, raw: Mapping[str, Any]) -> MessagesPlan:
    """The chat body of a Messages body (`raw`: as sent, for the sampling fields Anthropic's
    API does not have: seed, min_p, ...); raises APIError 400 naming the block at fault."""
    if not body.messages:
        raise invalid("messages", "must not be empty")
    if body.max_tokens < 1:
        raise invalid("max_tokens", f"must be at least 1, got {body.max_tokens}")
    system = system_text(body.system)
    messages = ([{"role": "system", "content": system}] if system else []) + chat_messages(
        body.messages
    )
    tools, left_out = _tools(body.tools or [])
    chat: dict[str, Any] = passed_fields(raw, MAPPED)
    chat |= {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": body.stop_sequences,
        "stream": body.stream,
        "response_format": _response_format(body.output_config),
    }
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    choice = body.tool_choice or {}
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = _tool_choice(choice, tools)
        if choice.get("disable_parallel_tool_use") is True:
            chat["parallel_tool_calls"] = False
    elif choice.get("type") not in (None, "auto", "none"):
        raise invalid("tool_choice", "requires tools this server can run")
    request = validated(ChatCompletionRequest, chat)
    return MessagesPlan(body, request, left_out)


def system_text(system: str | list[dict[str, Any]] | None) -> str:
    """The system prompt without the billing line Claude Code sends as a block of its own."""
    if system is None or isinstance(system, str):
        return system or ""
    blocks = [b for b in system if not str(b.get("text", "")).startswith(BILLING_HEADER)]
    return "\n\n".join(parts_text([b], f"system[{i}]", TEXT_BLOCKS) for i, b in enumerate(blocks))


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        content = message.get("content")
        if role == "system":
            out.append({"role": "system", "content": system_text(content)})
            continue
        if role not in ("user", "assistant"):
            raise invalid(f"{where}.role", f"must be user or assistant, got {role!r}")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise invalid(f"{where}.content", "must be a string or a list of content blocks")
        out += _blocks(role, content, where)
    return out


def _blocks(role: str, blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """One turn's blocks: its tool results as tool messages first, then its text (and, for the
    assistant, its calls) as one message."""
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            texts.append(parts_text([block], at, TEXT_BLOCKS))
        elif kind == "tool_use" and role == "assistant":
            name, call_id = string_field(block, "name", at), string_field(block, "id", at)
            arguments = block.get("input", {})
            if not isinstance(arguments, Mapping):
                raise invalid(f"{at}.input", "must be an object")
            function = {"name": name, "arguments": json.dumps(arguments)}
            calls.append({"id": call_id, "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            content = block.get("content", "")
            text = parts_text(content, f"{at}.content", TEXT_BLOCKS)
            if block.get("is_error") is True:
                text = f"Error: {text}"
            tool_id = string_field(block, "tool_use_id", at)
            results.append({"role": "tool", "tool_call_id": tool_id, "content": text})
        elif kind in SKIPPED_BLOCKS:
            continue
        elif kind in ("image", "document"):
            raise invalid(f"{at}.type", f"{kind} blocks are not supported: this model reads text")
        else:
            raise invalid(f"{at}.type", f"{kind!r} is not a {role} content block this server reads")
    turn: list[dict[str, Any]] = []
    if texts or calls or not results:
        message: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        turn.append(message)
    return results + turn


def _tools(tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """(chat function tools, the names of server tools left out)."""
    out, left_out = [], []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        name = string_field(tool, "name", where)
        if tool.get("type") not in (None, "custom"):  # web_search_..., bash_..., text_editor_...
            left_out.append(name)
            continue
        schema = tool.get("input_schema")
        if not isinstance(schema, Mapping):
            raise invalid(f"{where}.input_schema", "must be a JSON schema object")
        schema = {k: v for k, v in schema.items() if k != "$schema"}
        function = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        if isinstance(tool.get("strict"), bool):  # vLLM pins a call's arguments only if so
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out, left_out


def _tool_choice(choice: Mapping[str, Any], tools: list[dict[str, Any]]) -> Any:
    kind = choice.get("type", "auto")
    if kind == "tool":
        name = string_field(choice, "name", "tool_choice")
        return {"type": "function", "function": {"name": name}}
    if kind not in CHOICES:
        raise invalid("tool_choice.type", f"must be auto, any, tool or none, got {kind!r}")
    return CHOICES[kind]


def _response_format(config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    fmt = (config or {}).get("format")
    if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema":
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}
