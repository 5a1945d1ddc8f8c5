"""The event loop thread's scheduling policy beside the engine's threads (Linux).

As SCHED_OTHER the loop woke on the engine thread's core at every hand-out of a step's deltas
(the eventfd write of `call_soon_threadsafe`, then the GIL drop at the forward's call) and
preempted it there, before the forward's threads had forked: the teammate spun idle through the
loop's whole turn, every step. `perf` (sched_switch, c=1, 6 s): 2,400 of the engine thread's
2,500 preemptions were those two. As SCHED_BATCH the loop does not preempt on wake-up; it runs
at the next tick or yield, inside the forward, where a teammate redoes what a preempted thread
holds (thermostat/kernels/decode_stack.h). The engine thread is started first: threads inherit
their creator's policy.
"""

from __future__ import annotations

import contextlib
import os


def batch_policy() -> int | None:
    """Make the calling thread SCHED_BATCH; its policy before, or None if left unchanged (not
    Linux, refused, or not SCHED_OTHER)."""
    with contextlib.suppress(AttributeError, OSError):
        if (before := os.sched_getscheduler(0)) == os.SCHED_OTHER:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            return before
    return None


def restore_policy(policy: int | None) -> None:
    """Give the calling thread back the policy `batch_policy` returned."""
    if policy is not None:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, policy, os.sched_param(0))
