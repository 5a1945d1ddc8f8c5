"""Stored responses: what `previous_response_id`, `GET` and `DELETE /v1/responses/{id}` read.

A response is stored unless its request said `store: false`, with the conversation that led to
it (input messages, its own answer last; `instructions` are not carried over, as OpenAI's are
not). The store holds at most `capacity` responses; storing one more drops the oldest. It lives
in the server's memory: a restart forgets it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from thermostat.api.agents.content import CUSTOM_INPUT
from thermostat.api.errors import APIError

DEFAULT_CAPACITY = 1024


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages, the response's answer last


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._items[response["id"]] = Stored(response, [*conversation, answer(response)])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> Stored:
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError(
                404,
                f"response {response_id!r} not found: never stored here, stored with "
                f"store=false, deleted, or dropped (this server keeps the last "
                f"{self.capacity} responses)",
                param=param,
                code="response_not_found",
                type="invalid_request_error",
            )
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]


def answer(response: dict[str, Any]) -> dict[str, Any]:
    """A response's output as the assistant message of a chat conversation."""
    texts, calls = [], []
    for item in response.get("output", []):
        if item["type"] == "message":
            texts += [part.get("text", "") for part in item["content"]]
        elif item["type"] == "function_call":
            calls.append(_call(item["call_id"], item["name"], item["arguments"]))
        elif item["type"] == "custom_tool_call":
            arguments = json.dumps({CUSTOM_INPUT: item["input"]})
            calls.append(_call(item["call_id"], item["name"], arguments))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
