"""A client that leaves before its answer: `until_disconnected` cancels the work it was waiting
for (engine requests are aborted, an upstream request is closed) and raises ClientGone, which
the app answers with a bare 499 nobody reads (install_error_handlers). Torch-free: the gateway
uses it too."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its response was complete; its work was cancelled."""


async def until_disconnected(work: Awaitable[T], request: Request) -> T:
    """Await `work`, cancelling it (its finally-blocks release what it held) if the client
    disconnects first or if this task itself is cancelled."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: only that message is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
