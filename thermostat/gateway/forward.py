"""What goes upstream: the client's body with every sampling value replaced by the effective
one, named as the upstream's kind names it; and the client's disconnect, which cancels it.

| body field                           | sent upstream                                       |
|--------------------------------------|-----------------------------------------------------|
| the layered fields (temperature ...) | the effective value (absent when unknown)           |
| max_tokens / max_completion_tokens   | the effective max_tokens, as max_tokens             |
| seed                                 | as sent                                             |
| model                                | as sent, else the upstream's first model            |
| everything else (messages, stop ...) | as sent                                             |
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

from thermostat.gateway.defaults import GatewayDefaults, Resolved
from thermostat.sampling import LAYERED_FIELDS
from thermostat.server.errors import APIError

T = TypeVar("T")
_REPLACED = (*LAYERED_FIELDS, "max_tokens", "max_completion_tokens", "seed", "repeat_penalty")


def upstream_body(raw: dict[str, Any], resolved: Resolved, defaults: GatewayDefaults) -> dict:
    body = {k: v for k, v in raw.items() if k not in _REPLACED}
    body.update(resolved.sent(defaults.kind))
    if body.get("model") is None and defaults.info.models:
        body["model"] = defaults.info.model
    return body


class ClientGone(APIError):
    """The client left before its answer; the upstream request was cancelled."""

    def __init__(self) -> None:
        super().__init__(499, "client closed request", code="client_gone")


async def until_disconnected(work: Awaitable[T], request: Request) -> T:
    """Await `work`, cancelling it (and with it the upstream request) if the client
    disconnects first."""
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
    while (await request.receive())["type"] != "http.disconnect":
        pass
