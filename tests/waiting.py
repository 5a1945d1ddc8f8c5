"""Waiting in tests: on a condition or an event, never for a measured time. The time limit is
a guard against hangs, set far above the normal duration (seconds) so that a machine whose cores
are busy with other work does not trip it; tripping it says so."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

HANG_GUARD_S = 120.0  # far above anything a test waits for; only a hang reaches it


def hang(what: str, guard_s: float = HANG_GUARD_S) -> str:
    """The message of a tripped hang guard."""
    return f"hang guard: {what} not within {guard_s:.0f} s"


def wait_until(
    condition: Callable[[], bool], what: str, guard_s: float = HANG_GUARD_S, poll_s: float = 0.02
) -> None:
    """Returns once `condition()` holds; AssertionError naming `what` after `guard_s`."""
    deadline = time.monotonic() + guard_s
    while not condition():
        assert time.monotonic() < deadline, hang(what, guard_s)
        time.sleep(poll_s)


async def until(
    condition: Callable[[], bool],
    what: str = "the condition",
    guard_s: float = HANG_GUARD_S,
    poll_s: float = 0.005,
) -> None:
    """`wait_until` for a coroutine: polls without blocking the event loop."""
    deadline = time.monotonic() + guard_s
    while not condition():
        assert time.monotonic() < deadline, hang(what, guard_s)
        await asyncio.sleep(poll_s)
