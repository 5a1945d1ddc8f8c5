"""Checks on a request body before any route parses it, so bad bytes cost nothing.

| check                                  | answer                                       |
|----------------------------------------|----------------------------------------------|
| more than `max_body_bytes`             | 413 `request_too_large`, before reading it all |
| not UTF-8                              | 400 `invalid_utf8`                           |
| JSON nested deeper than MAX_JSON_DEPTH | 400 `json_too_deep`, before any parse        |
| a string with a lone UTF-16 surrogate  | 400 `invalid_unicode`, naming the field      |

Bodies are read here in full (bounded by the size limit) and handed on unchanged. The surrogate
check parses the JSON once; malformed JSON is left to the route, which answers it.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from thermostat.api.errors import APIError, error_response

if TYPE_CHECKING:
    from thermostat.api.middleware import GatedState

MAX_JSON_DEPTH = 64  # OpenAI bodies nest a handful of levels (messages -> content parts)


# A JSON string (skipped whole) or one bracket: the regex engine steps over string contents.
_STRUCTURE = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """True if the JSON text nests arrays/objects deeper than `limit` (brackets inside strings
    are not counted). No recursion; a body with at most `limit` opening brackets in all is not
    scanned at all."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    depth = 0
    for match in _STRUCTURE.finditer(body):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        elif token in (b"]", b"}"):
            depth -= 1
    return False


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The path (e.g. `messages[0].content`) of the first string holding a lone surrogate,
    which no tokenizer can encode; None if there is none. Keys are checked too."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return where or "body"
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((f"{where}.{key}" if where else str(key), key))
                stack.append((f"{where}.{key}" if where else str(key), child))
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", child) for i, child in enumerate(item))
    return None


def check_body(body: bytes) -> APIError | None:
    """The refusal for a body that no route should see, or None."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return APIError(400, f"the body is not valid UTF-8 ({exc.reason})", code="invalid_utf8")
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        return APIError(
            400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels", code="json_too_deep"
        )
    if "\\u" not in text:
        return None  # a lone surrogate can only arrive as a \u escape: the text itself is UTF-8
    try:
        parsed = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None  # the route answers malformed JSON
    where = lone_surrogate_path(parsed)
    if where is None:
        return None
    param = where.split(".")[0].split("[")[0]
    return APIError(
        400,
        f"{where}: contains a lone UTF-16 surrogate (not valid Unicode text)",
        param=param,
        code="invalid_unicode",
    )


class BodyLimitsMiddleware:
    def __init__(self, app: ASGIApp, state: GatedState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.state.config.max_body_bytes
        too_large = APIError(
            413,
            f"the request body is larger than this server's limit of {limit} bytes (--max-body-mb)",
            code="request_too_large",
        )
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await error_response(too_large, scope["path"])(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await error_response(too_large, scope["path"])(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        refusal = check_body(body)
        if refusal is not None:
            await error_response(refusal, scope["path"])(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out `body` once, then defers to the client's (disconnects)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
