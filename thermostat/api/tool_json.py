"""The JSON of tool calls in generated text, read by prefix: a call object's name once its
string is complete, and the raw text of its arguments so far (server/tool_parsers.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class CallSoFar:
    name: str | None = None  # once its JSON string is complete
    arguments: str = ""  # raw JSON text of the arguments so far
    complete: bool = False  # the call's object is closed and its arguments parse


def scan_json(text: str, start: int) -> tuple[int | None, dict[str, tuple[int, int | None]]]:
    """Scan the JSON object starting at `text[start]` ("{"). Returns (end, keys): `end` is one
    past its closing brace (None if the text ends first); `keys` maps each top-level key to its
    value's (start, end) span (end None while unfinished)."""
    depth, i, in_string, escaped = 0, start, False, False
    keys: dict[str, tuple[int, int | None]] = {}
    key_start: int | None = None
    pending_key: str | None = None
    value: tuple[str, int] | None = None  # (key, start) of the top-level value being read
    while i < len(text):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 1 and value is None and key_start is not None:
                    try:
                        pending_key = json.loads(text[key_start : i + 1])
                    except json.JSONDecodeError:
                        pending_key = None
                    key_start = None
        elif ch == '"':
            in_string = True
            if depth == 1 and value is None:
                key_start = i
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                if value is not None:
                    keys[value[0]] = (value[1], _rstrip(text, i))
                return i + 1, keys
        elif ch == ":" and depth == 1 and pending_key is not None:
            j = skip_ws(text, i + 1)
            value, pending_key = (pending_key, j), None
            keys[value[0]] = (j, None)
        elif ch == "," and depth == 1 and value is not None:
            keys[value[0]] = (value[1], _rstrip(text, i))
            value = None
        i += 1
    return None, keys


def _rstrip(text: str, end: int) -> int:
    while end > 0 and text[end - 1] in " \t\r\n":
        end -= 1
    return end


def read_call(text: str, start: int, args_key: str) -> tuple[CallSoFar, int | None]:
    """The call object at `text[start]`, and one past its end (None if unfinished)."""
    end, keys = scan_json(text, start)
    call = CallSoFar()
    if "name" in keys and keys["name"][1] is not None:
        name_start, name_end = keys["name"]
        try:
            name = json.loads(text[name_start:name_end])
            call.name = name if isinstance(name, str) else None
        except json.JSONDecodeError:
            pass
    if args_key in keys:
        a_start, a_end = keys[args_key]
        call.arguments = text[a_start : len(text) if a_end is None else a_end]
        if a_end is not None and end is not None:
            try:
                parsed = json.loads(call.arguments)
                if isinstance(parsed, str):  # arguments written as a JSON string
                    call.arguments = parsed
                call.complete = True
            except json.JSONDecodeError:
                pass
    return call, end


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i
