"""Rules every response of an OpenAI edge follows, `serve`'s and the gateway's alike.

| rule                                     | here                                             |
|------------------------------------------|--------------------------------------------------|
| which choice's quality is the response's | `response_quality`: the first degenerate, else 0 |
| how a stream is written                  | `sse`: events, in-band errors, then `[DONE]`     |
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from thermostat.api.errors import APIError, error_body
from thermostat.quality import quality_report


def response_quality(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The response's `quality` from its choices' reports (in index order): the first
    degenerate choice's report, else the first one's (an empty text's without choices)."""
    flagged = [r for r in reports if r.get("degenerate")]
    return (flagged or reports or [quality_report("")])[0]


def sse(events: AsyncIterator[str], on_error: Callable[[APIError], None]) -> StreamingResponse:
    """A server-sent event stream of JSON texts. An APIError raised once the 200 went out is
    reported in-band (`on_error` counts it first); the stream always ends with `[DONE]`."""

    async def body() -> AsyncIterator[str]:
        try:
            async for data in events:
                yield f"data: {data}\n\n"
        except APIError as err:
            on_error(err)
            yield f"data: {json.dumps(error_body(err))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
