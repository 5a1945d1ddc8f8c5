"""Rules every response of an OpenAI edge follows, `serve`'s and the gateway's alike.

| rule                                     | here                                             |
|------------------------------------------|--------------------------------------------------|
| which choice's quality is the response's | `response_quality`: the first degenerate, else 0 |
| how a stream is written                  | `sse`: events, in-band errors, then `[DONE]`     |
| a stream's token chunks, cheaply         | `ChunkTemplate`: the model's JSON, text spliced  |
| how a stream of named events is written  | `named_sse`: the agents' APIs (no `[DONE]`)      |
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from pydantic_core import to_json

from thermostat.api.errors import APIError, error_body
from thermostat.quality import quality_report


def response_quality(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The response's `quality` from its choices' reports (in index order): the first
    degenerate choice's report, else the first one's (an empty text's without choices)."""
    flagged = [r for r in reports if r.get("degenerate")]
    return (flagged or reports or [quality_report("")])[0]


# Characters JSON leaves raw inside strings that line splitters (Python's str.splitlines, httpx's
# iter_lines) take for line breaks: escaped, an event stays on its one `data:` line for them too.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(data: str) -> str:
    """One event of a JSON text (same JSON value, no raw line-break characters)."""
    if "\x85" in data or "\u2028" in data or "\u2029" in data:
        data = data.translate(_LINE_BREAKS)
    return f"data: {data}\n\n"


class ChunkTemplate:
    """The JSON text of a stream chunk whose one string field varies (a token's text), as its
    pydantic model writes it: `build(text)` is serialized once with a marker for the text, and
    each chunk is the JSON around the marker with the text's JSON string (pydantic's escaping)
    in between. The same bytes as `build(text).model_dump_json()`, at a tenth of its cost; should
    the marker show up elsewhere too, every chunk is built whole."""

    MARKER = "\x00thermostat-chunk\x00"

    def __init__(self, build: Callable[[str], BaseModel]) -> None:
        self._build = build
        parts = build(self.MARKER).model_dump_json().split(to_json(self.MARKER).decode())
        self._parts = parts if len(parts) == 2 else None

    def __call__(self, text: str) -> str:
        if self._parts is None:
            return self._build(text).model_dump_json()
        return self._parts[0] + to_json(text).decode() + self._parts[1]


def sse(events: AsyncIterator[str], on_error: Callable[[APIError], None]) -> StreamingResponse:
    """A server-sent event stream of JSON texts. An APIError raised once the 200 went out is
    reported in-band (`on_error` counts it first); the stream always ends with `[DONE]`."""

    async def body() -> AsyncIterator[str]:
        try:
            async for data in events:
                yield sse_event(data)
        except APIError as err:
            on_error(err)
            yield sse_event(json.dumps(error_body(err)))
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def named_sse(
    events: AsyncIterator[tuple[str, dict[str, Any]]],
    on_error: Callable[[APIError], None],
    error_event: Callable[[APIError], tuple[str, dict[str, Any]]],
) -> StreamingResponse:
    """A stream of named events (`event:` and `data:` lines), as the Responses and Messages APIs
    write them; an APIError raised once the 200 went out becomes the API's error event."""

    def write(name: str, data: dict[str, Any]) -> str:
        return f"event: {name}\n" + sse_event(json.dumps(data))

    async def body() -> AsyncIterator[str]:
        try:
            async for name, data in events:
                yield write(name, data)
        except APIError as err:
            on_error(err)
            yield write(*error_event(err))

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
