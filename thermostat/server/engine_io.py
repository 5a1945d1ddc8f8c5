"""What crosses between the event loop and the engine thread (server/async_engine.py): commands
(a group of engine requests, an abort, a call) going in, each group's deltas coming out (the
engine's counters: thermostat.api.metrics.EngineStats)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from thermostat.engine.outputs import QueuedRequest, RequestDelta
from thermostat.engine.steps import Handoff
from thermostat.sampling.fanout import Plan

if TYPE_CHECKING:
    from thermostat.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class GroupInput:
    """One response's requests: a plan's choices, each an engine request (LLMEngine.add_group)."""

    group_id: str
    plan: Plan
    handoff: bool = False  # prefill role: compute, sample the first token, hand over
    handoffs: list[Handoff] | None = None  # decode role: a prefill's handoff per choice


class OutputStream:
    """The deltas of a group of engine requests (one response's choices), in arrival order.

    Iterating yields `(index, RequestDelta)` until every request of the group has finished;
    it raises EngineError if the engine failed. `abort()` stops the unfinished ones."""

    def __init__(
        self, abort: Callable[[list[str]], None], on_close: Callable[[OutputStream], None]
    ) -> None:
        self.queued: list[QueuedRequest] = []  # set when the engine accepts the group
        self._index: dict[str, int] = {}
        self._items: deque[RequestDelta | BaseException] = deque()
        self._waiter: asyncio.Future[None] | None = None  # the reader's, while it waits
        self._unfinished: set[str] = set()
        self._abort, self._on_close = abort, on_close

    def bind(self, queued: list[QueuedRequest]) -> None:
        self.queued = queued
        self._index = {q.req_id: q.index for q in queued}
        self._unfinished = set(self._index)

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> tuple[int, RequestDelta]:
        if not self._unfinished:
            raise StopAsyncIteration
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self._close()
            raise item
        if item.finished:
            self._unfinished.discard(item.req_id)
            if not self._unfinished:
                self._close()
        return self._index[item.req_id], item

    def abort(self) -> None:
        """Abort the requests that have not finished (idempotent); their KV blocks are freed."""
        if self._unfinished:
            self._abort(sorted(self._unfinished))
            self._close()

    def _close(self) -> None:
        self._unfinished.clear()
        self._on_close(self)

    def put(self, item: RequestDelta | BaseException) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


@dataclass
class Add:
    group: GroupInput
    stream: OutputStream
    done: asyncio.Future[None]


@dataclass
class Call:
    """Run `fn(engine)` on the engine thread between steps (e.g. a prefix-cache reset)."""

    fn: Callable[[LLMEngine], Any]
    done: asyncio.Future[Any]


@dataclass
class Abort:
    req_ids: list[str]


@dataclass
class AbortStream:
    """Abort whatever of a stream's group the engine accepted (its add was cancelled)."""

    stream: OutputStream


class Stop:
    pass


Command = Add | Call | Abort | AbortStream | Stop
