"""A chat stream as the Responses API's events (the table in responses_output.py): the message
item opened at the first text and closed when a call begins or the answer ends, each call an item
of its own, the response last, made by `ResponseBuilder.final` as the whole one is."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from thermostat.api.agents.responses_output import Call, ResponseBuilder
from thermostat.api.tools import call_id


async def response_events(
    builder: ResponseBuilder, chunks: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    """The Responses events of a chat stream (with a usage chunk last), numbered."""
    number = 0
    async for event in EventStream(builder).run(chunks):
        event["sequence_number"] = number
        number += 1
        yield event


@dataclass
class EventStream:
    builder: ResponseBuilder
    text: str | None = None  # the message's text so far; None: no message item yet
    text_open: bool = False
    calls: list[Call] = field(default_factory=list)
    open_call: bool = False
    index: int = 0  # the output index the next item takes

    async def run(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        b = self.builder
        yield {"type": "response.created", "response": b.shell()}
        yield {"type": "response.in_progress", "response": b.shell()}
        finish, usage, extra = None, None, {}
        async for chunk in chunks:
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    for event in self._text(delta["content"]):
                        yield event
                for piece in delta.get("tool_calls") or []:
                    for event in self._call_piece(piece):
                        yield event
                if choice.get("finish_reason") is not None:
                    finish = choice["finish_reason"]
                    extra = {str(k): chunk[k] for k in ("sampling", "quality") if k in chunk}
                    for event in self._close(finish == "length"):
                        yield event
        response = b.final(self.text, self.calls, finish, usage, extra)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield {"type": kind, "response": response}

    def _text(self, text: str) -> list[dict[str, Any]]:
        b = self.builder
        events = []
        if self.text is None:
            self.text, self.text_open = "", True
            item = b.message_item("", "in_progress") | {"content": []}
            events.append(
                {"type": "response.output_item.added", "output_index": self.index, "item": item}
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(
                {
                    "type": "response.content_part.added",
                    "item_id": b.message_id,
                    "output_index": self.index,
                    "content_index": 0,
                    "part": part,
                }
            )
        self.text += text
        events.append(
            {
                "type": "response.output_text.delta",
                "item_id": b.message_id,
                "output_index": self.index,
                "content_index": 0,
                "delta": text,
                "logprobs": [],
            }
        )
        return events

    def _close_text(self, cut: bool) -> list[dict[str, Any]]:
        if not self.text_open:
            return []
        self.text_open = False
        b, text = self.builder, self.text or ""
        item = b.message_item(text, "incomplete" if cut else "completed")
        where = {"item_id": b.message_id, "output_index": self.index, "content_index": 0}
        events = [
            {"type": "response.output_text.done", **where, "text": text, "logprobs": []},
            {"type": "response.content_part.done", **where, "part": item["content"][0]},
            {"type": "response.output_item.done", "output_index": self.index, "item": item},
        ]
        self.index += 1
        return events

    def _call_piece(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        function = piece.get("function") or {}
        events = []
        if piece.get("id") is not None:  # a new call: what was open ends
            events += self._close_text(False) + self._close_call()
            self.calls.append(Call(piece["id"] or call_id(), function.get("name") or ""))
            self.open_call = True
            call = self.calls[-1]
            if call.name not in self.builder.plan.custom_tools:
                item = self.builder.call_item(call, "in_progress")
                events.append(
                    {"type": "response.output_item.added", "output_index": self.index, "item": item}
                )
        piece_args = function.get("arguments") or ""
        if piece_args and self.calls:
            call = self.calls[-1]
            call.arguments += piece_args
            if call.name not in self.builder.plan.custom_tools:
                item_id = self.builder.call_item(call)["id"]
                events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": item_id,
                        "output_index": self.index,
                        "delta": piece_args,
                    }
                )
        return events

    def _close_call(self, cut: bool = False) -> list[dict[str, Any]]:
        if not self.open_call:
            return []
        self.open_call = False
        call = self.calls[-1]
        item = self.builder.call_item(call, "incomplete" if cut else "completed")
        at = {"item_id": item["id"], "output_index": self.index}
        if item["type"] == "custom_tool_call":
            added = item | {"status": "in_progress", "input": ""}
            events = [
                {"type": "response.output_item.added", "output_index": self.index, "item": added},
                {"type": "response.custom_tool_call_input.delta", **at, "delta": item["input"]},
                {"type": "response.custom_tool_call_input.done", **at, "input": item["input"]},
            ]
        else:
            events = [
                {
                    "type": "response.function_call_arguments.done",
                    **at,
                    "name": call.name,
                    "arguments": call.arguments,
                }
            ]
        events.append(
            {"type": "response.output_item.done", "output_index": self.index, "item": item}
        )
        self.index += 1
        return events

    def _close(self, cut: bool) -> list[dict[str, Any]]:
        if self.text is None and not self.calls:  # an empty answer is an empty message
            events = self._text("")[:2]  # its item and part added, no (empty) delta
            return events + self._close_text(cut)
        return self._close_text(cut) + self._close_call(cut)
