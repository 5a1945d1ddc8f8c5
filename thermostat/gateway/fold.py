"""A stream's annotated chunks folded into the whole response a non-streamed request gets.

Under --stop-on-loop a non-streamed request is asked of the upstream as a stream, so a loop can
be cut as it happens (relay.StreamAnnotator, the streaming path's cut rule); the client still
gets one whole response. Per choice:

| stream (chunks, in order)                  | whole response                               |
|--------------------------------------------|----------------------------------------------|
| chat `delta` strings (content, reasoning)  | `message` strings, concatenated              |
| chat `delta.role`                          | `message.role` (assistant when none came)    |
| chat `delta.tool_calls[i]` pieces          | `message.tool_calls[i]`, arguments joined    |
| completions `text`                         | `text`, concatenated                         |
| `logprobs` lists                           | the lists, concatenated                      |
| finish_reason, stop_reason, quality        | as the finishing chunk has them              |
| the finishing chunk's `sampling`           | the choice's, where it differs from the      |
|                                            | response's (`sampling`, given)               |
| `usage` (any chunk)                        | `usage`                                      |
"""

from __future__ import annotations

from typing import Any

from thermostat.api.responses import response_quality
from thermostat.gateway.upstream import UpstreamError, bad_response

PASSED = ("finish_reason", "stop_reason", "quality")


class Fold:
    """The whole response of `endpoint` ("chat" or "completions"), built chunk by chunk."""

    def __init__(self, endpoint: str, sampling: dict[str, Any]) -> None:
        self.chat = endpoint == "chat"
        self.sampling = sampling  # the response's
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.choice_sampling: dict[int, dict[str, Any]] = {}  # from each finishing chunk
        self.usage: Any = None

    def add(self, chunk: dict[str, Any]) -> None:
        if "choices" not in chunk and "error" in chunk:
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise UpstreamError(502, f"the upstream failed mid-answer: {message}", "upstream_error")
        for key in ("id", "created", "model", "system_fingerprint"):
            self.head.setdefault(key, chunk.get(key))
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk["choices"]:
            self._add_choice(choice)
            if choice.get("finish_reason") is not None and isinstance(chunk.get("sampling"), dict):
                self.choice_sampling[choice.get("index", 0)] = chunk["sampling"]

    def _add_choice(self, piece: dict[str, Any]) -> None:
        index = piece.get("index", 0)
        choice = self.choices.setdefault(index, self._empty(index))
        if self.chat:
            _merge_delta(choice["message"], piece.get("delta") or {})
        elif isinstance(piece.get("text"), str):
            choice["text"] += piece["text"]
        if isinstance(piece.get("logprobs"), dict):
            _merge_lists(choice.setdefault("logprobs", {}), piece["logprobs"])
        for key in PASSED:
            if piece.get(key) is not None:
                choice[key] = piece[key]

    def _empty(self, index: int) -> dict[str, Any]:
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": ""},
                    "finish_reason": None}  # fmt: skip
        return {"index": index, "text": "", "finish_reason": None}

    def response(self) -> dict[str, Any]:
        """The whole response (its `sampling` and `quality` the annotated chunks')."""
        if not self.choices:
            raise bad_response("a stream without choices")
        choices = [self.choices[i] for i in sorted(self.choices)]
        for choice in choices:
            message = choice.get("message") or {}
            if message.get("tool_calls") and not message.get("content"):
                message["content"] = None  # a tool call's answer has no text
        reports = [c["quality"] for c in choices if "quality" in c]
        out = {
            **{k: v for k, v in self.head.items() if v is not None},
            "object": "chat.completion" if self.chat else "text_completion",
            "choices": choices,
        }
        if self.usage is not None:
            out["usage"] = self.usage
        theirs = self.choice_sampling.get(choices[0]["index"], {}).get("upstream")
        out["sampling"] = self.sampling | ({"upstream": theirs} if theirs else {})
        for choice in choices:
            own = self.choice_sampling.get(choice["index"], self.sampling)
            if {k: v for k, v in own.items() if k != "upstream"} != self.sampling:
                choice["sampling"] = own
        if reports:
            out["quality"] = response_quality(reports)
        return out


def _merge_delta(message: dict[str, Any], delta: dict[str, Any]) -> None:
    for key, value in delta.items():
        if value is None:
            continue
        if key == "role":
            message["role"] = value
        elif key == "tool_calls" and isinstance(value, list):
            calls = message.setdefault("tool_calls", [])
            for piece in value:
                _merge_call(calls, piece)
        elif isinstance(value, str):
            message[key] = (message.get(key) or "") + value
        else:
            message[key] = value


def _merge_call(calls: list[dict[str, Any]], piece: dict[str, Any]) -> None:
    """One `delta.tool_calls` piece into the call of its index."""
    index = piece.get("index", len(calls))
    while len(calls) <= index:
        calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    call = calls[index]
    for key in ("id", "type"):
        if piece.get(key):
            call[key] = piece[key]
    function = piece.get("function") or {}
    for key in ("name", "arguments"):
        if isinstance(function.get(key), str):
            call["function"][key] += function[key]


def _merge_lists(into: dict[str, Any], piece: dict[str, Any]) -> None:
    for key, value in piece.items():
        if isinstance(value, list):
            into.setdefault(key, []).extend(value)
        elif value is not None:
            into[key] = value
