"""A chat answer as a Response object (streamed: the events of responses_events.py).

Both end in the same object, made by `ResponseBuilder.final` from the answer's text and calls,
so the official SDK's stream accumulator gets what `responses.create` returns. The events:

| when                         | events                                                          |
|------------------------------|-----------------------------------------------------------------|
| start                        | response.created, response.in_progress                          |
| first text                   | output_item.added (message), content_part.added                 |
| text                         | output_text.delta                                               |
| text ends                    | output_text.done, content_part.done, output_item.done           |
| a call is named              | output_item.added (function_call)                               |
| its arguments                | function_call_arguments.delta                                   |
| it ends                      | function_call_arguments.done, output_item.done                  |
| a custom tool's call ends    | output_item.added, custom_tool_call_input.delta/.done, item.done|
| end                          | response.completed, or response.incomplete (max_output_tokens)  |

A call's item id is `fc_` + its call id's hex (`ctc_` for a custom tool), the message's `msg_` +
the response's: the same in both shapes.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from thermostat.api.agents.content import custom_input
from thermostat.api.agents.responses_input import ResponsesPlan


@dataclass
class Call:
    call_id: str
    name: str
    arguments: str = ""


@dataclass
class ResponseBuilder:
    plan: ResponsesPlan
    model: str  # the served model's name
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def message_id(self) -> str:
        return "msg_" + self.id.removeprefix("resp_")

    def shell(self, status: str = "in_progress") -> dict[str, Any]:
        """The response object without output: what the request asked for, echoed."""
        body = self.plan.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning or {"effort": None, "summary": None},
            "store": body.store is not False,
            "temperature": body.temperature,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": body.user,
            "metadata": body.metadata or {},
            "prompt_cache_key": body.prompt_cache_key,
        }

    def message_item(self, text: str, status: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {
            "id": self.message_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": [part],
        }

    def call_item(self, call: Call, status: str = "completed") -> dict[str, Any]:
        hex_id = call.call_id.removeprefix("call_")
        if call.name in self.plan.custom_tools:
            return {
                "id": f"ctc_{hex_id}",
                "type": "custom_tool_call",
                "status": status,
                "call_id": call.call_id,
                "name": call.name,
                "input": custom_input(call.arguments),
            }
        return {
            "id": f"fc_{hex_id}",
            "type": "function_call",
            "status": status,
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        }

    def final(
        self,
        text: str | None,
        calls: list[Call],
        finish_reason: str | None,
        usage: dict[str, Any] | None,
        extra: dict[str, Any],
    ) -> dict[str, Any]:
        """The finished response: `extra` holds the chat answer's `sampling` and `quality`."""
        cut = finish_reason == "length"
        status = "incomplete" if cut else "completed"
        output = [self.message_item(text or "", "completed")] if text or not calls else []
        output += [self.call_item(c) for c in calls]
        if cut:  # the last item is where the tokens ran out
            output[-1]["status"] = "incomplete"
        response = self.shell(status) | {"output": output, "usage": _usage(usage)}
        if cut:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.plan.left_out:
            response["tools_left_out"] = self.plan.left_out
        return response | extra

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The response of a whole chat completion."""
        choice = chat["choices"][0]
        message = choice["message"]
        calls = [
            Call(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or []
        ]
        extra: dict[str, Any] = {k: chat[k] for k in ("sampling", "quality") if k in chat}
        return self.final(
            message.get("content"), calls, choice["finish_reason"], chat.get("usage"), extra
        )


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens") or 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }
