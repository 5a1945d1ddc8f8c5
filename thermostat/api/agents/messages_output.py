"""A chat answer as an Anthropic Message (whole) or as the Messages API's events (streamed).

| chat                                   | Messages                                         |
|----------------------------------------|--------------------------------------------------|
| content                                | a `text` block                                   |
| tool_calls                             | `tool_use` blocks (`input`: the arguments object)|
| finish `stop`, a stop sequence matched | stop_reason `stop_sequence`, `stop_sequence` set |
| finish `stop` otherwise                | `end_turn` (a loop cut by --stop-on-loop too)    |
| finish `tool_calls` / `length`         | `tool_use` / `max_tokens`                        |
| finish `stop` with calls (1)           | `tool_use`                                       |
| usage: prompt tokens not cached        | `input_tokens`                                   |
| usage: prompt tokens from the cache    | `cache_read_input_tokens`                        |
| usage: completion tokens               | `output_tokens`                                  |

Streamed: `message_start`, then per block `content_block_start`, its deltas (`text_delta`,
`input_json_delta`), `content_block_stop`; a `ping` after the first block starts;
`message_delta` (stop_reason, usage, and the `sampling` and `quality` objects) and
`message_stop`. `message_start`'s message carries `sampling` too (the SDK's accumulated
message keeps it from there: it takes only stop_reason and usage from `message_delta`).
A tool_use block's id is `toolu_` + its call id's hex, the same in both shapes.

(1) vLLM, as OpenAI, ends a call forced by name with `stop`; `serve` with `tool_calls`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from thermostat.api.agents.content import tool_arguments
from thermostat.api.agents.messages_input import MessagesPlan


@dataclass
class MessageBuilder:
    plan: MessagesPlan
    model: str
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")

    def shell(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }

    def ending(
        self, finish_reason: str | None, stop_reason: Any, called: bool = False
    ) -> dict[str, Any]:
        """`stop_reason` and `stop_sequence` of a chat choice's end (`called`: with calls)."""
        stops = self.plan.body.stop_sequences or []
        if finish_reason == "stop" and isinstance(stop_reason, str) and stop_reason in stops:
            return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
        if called and finish_reason in (None, "stop"):
            finish_reason = "tool_calls"
        reasons = {"length": "max_tokens", "tool_calls": "tool_use"}
        return {
            "stop_reason": reasons.get(finish_reason or "stop", "end_turn"),
            "stop_sequence": None,
        }

    def extra(self, chat: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {k: chat[k] for k in ("sampling", "quality") if k in chat}
        if self.plan.left_out:
            out["tools_left_out"] = self.plan.left_out
        return out

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        message = choice["message"]
        content: list[dict[str, Any]] = []
        if message.get("content") or not message.get("tool_calls"):
            content.append({"type": "text", "text": message.get("content") or ""})
        for call in message.get("tool_calls") or []:
            function = call["function"]
            content.append(_tool_use(call["id"], function["name"], function["arguments"]))
        called = bool(message.get("tool_calls"))
        ending = self.ending(choice["finish_reason"], choice.get("stop_reason"), called)
        return (
            self.shell()
            | {"content": content, **ending, "usage": _usage(chat.get("usage"))}
            | self.extra(chat)
        )

    async def events(
        self, chunks: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(event name, data) of a chat stream with a usage chunk last."""
        chunks = aiter(chunks)
        first = await anext(chunks, None)
        opening = {"sampling": first["sampling"]} if first and "sampling" in first else {}
        yield "message_start", {"type": "message_start", "message": self.shell() | opening}
        block = -1  # the open block's index
        kind: str | None = None  # its type
        ending: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        usage = None
        called = False  # a tool_use block was started

        def start(new_kind: str, content_block: dict[str, Any]) -> list[tuple[str, dict]]:
            nonlocal block, kind
            events = stop()
            block, kind = block + 1, new_kind
            events.append(
                (
                    "content_block_start",
                    {"type": "content_block_start", "index": block, "content_block": content_block},
                )
            )
            if block == 0:
                events.append(("ping", {"type": "ping"}))
            return events

        def stop() -> list[tuple[str, dict]]:
            nonlocal kind
            if kind is None:
                return []
            kind = None
            return [("content_block_stop", {"type": "content_block_stop", "index": block})]

        def delta(payload: dict[str, Any]) -> tuple[str, dict]:
            return "content_block_delta", {
                "type": "content_block_delta",
                "index": block,
                "delta": payload,
            }

        async for chunk in _prepend(first, chunks):
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                d = choice.get("delta") or {}
                if d.get("content"):
                    if kind != "text":
                        for event in start("text", {"type": "text", "text": ""}):
                            yield event
                    yield delta({"type": "text_delta", "text": d["content"]})
                for piece in d.get("tool_calls") or []:
                    function = piece.get("function") or {}
                    if piece.get("id") is not None:
                        called = True
                        head = _tool_use(piece["id"], function.get("name") or "", "") | {
                            "input": {}
                        }
                        for event in start("tool_use", head):
                            yield event
                    if function.get("arguments"):
                        yield delta(
                            {"type": "input_json_delta", "partial_json": function["arguments"]}
                        )
                if choice.get("finish_reason") is not None:
                    ending = self.ending(choice["finish_reason"], choice.get("stop_reason"), called)
                    extra = self.extra(chunk)
                    if block < 0:  # an empty answer is an empty text block
                        for event in start("text", {"type": "text", "text": ""}):
                            yield event
                    for event in stop():
                        yield event
        yield (
            "message_delta",
            {"type": "message_delta", "delta": ending, "usage": _usage(usage)} | extra,
        )
        yield "message_stop", {"type": "message_stop"}


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": "toolu_" + call_id.removeprefix("call_"),
        "name": name,
        "input": tool_arguments(arguments),
    }


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    if not usage:
        return {"input_tokens": 0, "output_tokens": 0}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": usage["prompt_tokens"] - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": usage["completion_tokens"],
    }


async def _prepend(
    first: dict[str, Any] | None, rest: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    if first is not None:
        yield first
    async for chunk in rest:
        yield chunk
