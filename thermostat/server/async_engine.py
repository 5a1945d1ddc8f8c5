"""The engine behind the event loop: one thread owns the LLMEngine and runs its step loop.

Threads and what crosses between them:

| direction        | channel                              | carries                          |
|------------------|--------------------------------------|----------------------------------|
| loop -> engine   | `queue.SimpleQueue` of commands      | add (a group), abort, call       |
| engine -> loop   | `loop.call_soon_threadsafe(...)`     | their results, deltas, stats     |

Invariants:
- The engine thread builds the LLMEngine (loads the model) and is then the only thread that
  touches it, and the only thread of the server that computes with torch. PyTorch's OpenMP
  runtime (libgomp) gives each thread that enters a parallel region its own team of workers; once
  the process has more OpenMP workers than cores, libgomp throttles their spin-wait, so every one
  of the ~350 small parallel regions of a decode step waits for a futex wake-up. A model loaded
  on one thread and stepped on another ran batch-1 decode at half speed.
- Commands are applied between steps, in order.
- The engine thread blocks on the command queue while the engine has nothing to do (no busy
  loop); while it has work it drains pending commands without blocking, then steps.
- Nothing the loop receives is touched by the engine again: deltas are new objects each step,
  and the stats that arrive with them describe the engine as of their sending.
- A step's deltas are held until the next forward starts (sent at once if none follows): the
  loop makes chunks while the engine thread is in the kernels, not while its Python between two
  forwards needs the GIL (that stretch grew 0.95 ms a step at c=1 and 3.4 ms at c=32 under HTTP).
- Once the engine thread runs, the loop's thread is SCHED_BATCH until `stop` (loop_policy.py).
- An add is the engine's `add_group`, all or nothing: if it refuses, the caller's `add` raises
  the engine's exception (InvalidRequest for bad input; anything else is a bug).
- If a step raises, every in-flight request is aborted (its KV blocks freed) and its stream
  raises EngineError; the thread keeps serving new requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from thermostat.api.errors import EngineError
from thermostat.api.metrics import EngineStats
from thermostat.engine.llm_engine import LLMEngine
from thermostat.engine.outputs import RequestDelta
from thermostat.server.engine_io import (
    Abort,
    AbortStream,
    Add,
    Call,
    Command,
    GroupInput,
    OutputStream,
    Stop,
)
from thermostat.server.loop_policy import batch_policy, restore_policy

log = logging.getLogger("thermostat.server")
T = TypeVar("T")


class AsyncEngine:
    """Async front of an LLMEngine; create and use it from the event loop that serves requests."""

    def __init__(self, build: Callable[[], LLMEngine]) -> None:
        self._build = build
        self.engine: LLMEngine  # set by the engine thread once built (`start` returns it)
        self.stats = EngineStats()
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._streams: dict[str, OutputStream] = {}  # engine thread only: req_id -> stream
        self._held: list[tuple[OutputStream, RequestDelta]] = []  # engine thread: a step's deltas
        self._active: set[OutputStream] = set()  # loop only: streams not finished
        self._pending_adds = 0  # loop only: adds sent, not yet applied
        self._loop_policy: int | None = None  # the loop thread's scheduling policy before start

    # ---- event-loop side ----

    async def start(self) -> LLMEngine:
        """Start the engine thread, which builds the engine and then runs its step loop; return
        the engine once built, or raise what building it raised."""
        self._loop = asyncio.get_running_loop()
        built: asyncio.Future[LLMEngine] = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._main, args=(built,), name="thermostat-engine", daemon=True
        )
        self._thread.start()
        self._loop_policy = batch_policy()
        return await built

    @property
    def num_waiting(self) -> int:
        """Requests queued and not yet admitted, including adds the engine has not applied."""
        return self.stats.num_waiting + self._pending_adds

    @property
    def num_in_flight(self) -> int:
        """Groups (responses) still producing outputs."""
        return len(self._active)

    async def add(self, group: GroupInput) -> OutputStream:
        """Queue a group of requests; raises the engine's error if it is refused. The stream's
        `queued` lists the requests with the sampling each runs with."""
        if self._thread is None or not self._thread.is_alive():
            raise EngineError("the engine is not running")
        stream = OutputStream(self.abort, self._active.discard)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending_adds += 1
        self._commands.put(Add(group, stream, done))
        try:
            await done
        except asyncio.CancelledError:
            self._commands.put(AbortStream(stream))  # the add may have been applied
            raise
        finally:
            self._pending_adds -= 1
        self._active.add(stream)
        return stream

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """`fn(engine)`, run on the engine thread between two steps; raises what it raised."""
        if self._thread is None or not self._thread.is_alive():
            raise EngineError("the engine is not running")
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._commands.put(Call(fn, done))
        return await done

    def abort(self, req_ids: list[str]) -> None:
        self._commands.put(Abort(list(req_ids)))

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no response is in flight; False if `timeout_s` passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self._active

    async def stop(self) -> None:
        """Stop the thread; streams still open raise EngineError."""
        if self._thread is None:
            return
        self._commands.put(Stop())
        await asyncio.to_thread(self._thread.join, 30.0)
        for stream in list(self._active):
            stream.put(EngineError("the server is shutting down"))
        self._thread = None
        restore_policy(self._loop_policy)

    def _publish(
        self,
        results: list[tuple[Add | Call, Any]],
        items: list[tuple[OutputStream, RequestDelta | BaseException]],
        stats: EngineStats,
    ) -> None:
        """Runs on the loop: settle adds, hand out deltas, take the new stats."""
        self.stats = stats
        for command, result in results:
            if command.done.done():  # the caller was cancelled (an add's abort is queued)
                continue
            if isinstance(result, BaseException):
                command.done.set_exception(result)
            elif isinstance(command, Add):
                command.stream.bind(result)
                command.done.set_result(None)
            else:
                command.done.set_result(result)
        for stream, item in items:
            stream.put(item)

    # ---- engine-thread side ----

    def _send(self, results: list, items: list) -> None:
        assert self._loop is not None
        items, self._held = self._held + items, []
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self._loop.call_soon_threadsafe(self._publish, results, items, self._stats())

    def _send_held(self) -> None:
        if self._held:
            self._send([], [])

    def _stats(self) -> EngineStats:
        blocks = self.engine.blocks
        return EngineStats(
            num_running=self.engine.num_running,
            num_waiting=self.engine.num_waiting,
            num_blocks=blocks.num_blocks,
            num_free_blocks=blocks.num_free_blocks,
            kv_cache_usage=blocks.usage,
            prefix_cache_queries=blocks.prefix_cache_queries,
            prefix_cache_hits=blocks.prefix_cache_hits,
        )

    def _main(self, built: asyncio.Future[LLMEngine]) -> None:
        assert self._loop is not None
        try:
            self.engine = self._build()
        except BaseException as exc:
            self._loop.call_soon_threadsafe(built.set_exception, exc)
            return
        self._loop.call_soon_threadsafe(built.set_result, self.engine)
        self._run()

    def _run(self) -> None:
        while True:
            try:
                command = self._commands.get(block=not self.engine.has_unfinished())
            except queue.Empty:
                command = None
            results: list[tuple[Add | Call, Any]] = []
            while command is not None:
                if isinstance(command, Stop):
                    self._fail_all(EngineError("the server is shutting down"))
                    return
                self._apply(command, results)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if results or not self.engine.has_unfinished():
                self._send(results, [])
            if self.engine.has_unfinished():
                self._step()

    def _apply(self, command: Add | Call | Abort | AbortStream, results: list) -> None:
        if isinstance(command, Call):
            try:
                results.append((command, command.fn(self.engine)))
            except Exception as exc:
                results.append((command, exc))
            return
        if isinstance(command, Abort | AbortStream):
            if isinstance(command, AbortStream):
                req_ids = [r for r, s in self._streams.items() if s is command.stream]
            else:
                req_ids = command.req_ids
            for req_id in req_ids:
                self.engine.abort(req_id)
                self._streams.pop(req_id, None)
            return
        group = command.group
        try:
            queued = self.engine.add_group(
                group.group_id,
                group.plan,
                handoff=group.handoff,
                handoffs=group.handoffs,
            )
        except Exception as exc:  # refused: the engine keeps nothing of the group
            results.append((command, exc))
            return
        for item in queued:
            self._streams[item.req_id] = command.stream
        results.append((command, queued))

    def _step(self) -> None:
        try:
            deltas = self.engine.step(before_forward=self._send_held)
        except Exception as exc:
            log.exception("engine step failed; failing %d in-flight requests", len(self._streams))
            self._fail_all(EngineError(f"the engine failed while generating: {exc!r}"))
            return
        self._send_held()  # a step without a forward: the last step's deltas go now
        items: list[tuple[OutputStream, RequestDelta]] = []
        for delta in deltas:
            stream = self._streams.get(delta.req_id)
            if stream is None:
                continue  # aborted meanwhile
            if delta.finished:
                del self._streams[delta.req_id]
            items.append((stream, delta))
        if self.engine.has_unfinished():
            self._held += items  # sent when the next step's forward starts
        else:
            self._send([], items)

    def _fail_all(self, error: EngineError) -> None:
        items: list[tuple[OutputStream, RequestDelta | BaseException]] = []
        failed: set[int] = set()
        for req_id, stream in list(self._streams.items()):
            try:
                self.engine.abort(req_id)
            except Exception:
                log.exception("abort of %s failed after an engine error", req_id)
            if id(stream) not in failed:
                failed.add(id(stream))
                items.append((stream, error))
        self._streams.clear()
        self._send([], items)
