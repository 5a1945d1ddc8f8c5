"""The prefill's rooms (`RoomTable`): each room's handoff (`PackedHandoff`: a header and the KV
tensors) parked from the prefill's put until a decode server's claim takes it
(thermostat.disagg.bootstrap serves the claims), or until it expires."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from thermostat.disagg.wire import DTYPES

log = logging.getLogger("thermostat.disagg")
MAX_ROOM = 1 << 63  # room ids are in [0, MAX_ROOM)


@dataclass(frozen=True)
class PackedHandoff:
    """A room's contents: the caller's JSON header and the KV tensors."""

    header: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class RoomError(Exception):
    """A room could not be handed over; `code` is one of the table in the module docstring."""

    def __init__(self, code: str, message: str, remote_code: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.remote_code = remote_code  # the prefill's ERROR code, when it sent one


def is_room(room: object) -> TypeGuard[int]:
    return isinstance(room, int) and not isinstance(room, bool) and 0 <= room < MAX_ROOM


def check_room(room: object) -> None:
    if not is_room(room):
        raise ValueError(f"room id {room!r} is not an integer in [0, 2**63)")


@dataclass
class _Room:
    """One room id in the table. `arrived` is set once, by put or fail, which also start the
    expiry timer that removes the entry whatever it then holds; `taken` is set by the take that
    gets it, after which the entry is a tombstone that refuses other takes."""

    arrived: bool = False
    taken: bool = False
    handoff: PackedHandoff | None = None  # until taken
    error: RoomError | None = None  # from fail, until taken
    waiter: asyncio.Future[None] | None = None  # a take waiting for the room to arrive


class RoomTable:
    """The prefill's rooms, from put (or fail) until a claim takes them or they expire.

    | entry       | holds                         | leaves                                      |
    |-------------|-------------------------------|---------------------------------------------|
    | waiting     | a take that came first        | when the take gives up (timeout, cancelled) |
    | parked      | a PackedHandoff, or an error  | (taken)                                     |
    | taken       | nothing: a tombstone          | (expired)                                   |
    | any arrived | -                             | `ttl_s` after put / fail (one timer each)   |

    Rooms that expire untaken count in `expired_total`. Use from the event loop thread only.
    """

    def __init__(self, ttl_s: float = 60.0) -> None:
        self.ttl_s = ttl_s
        self.expired_total = 0
        self._rooms: dict[int, _Room] = {}

    @property
    def num_parked(self) -> int:
        """Rooms holding a PackedHandoff that no claim has taken yet."""
        return sum(1 for r in self._rooms.values() if r.handoff is not None)

    @property
    def bytes_parked(self) -> int:
        return sum(r.handoff.nbytes for r in self._rooms.values() if r.handoff is not None)

    @property
    def num_waiting(self) -> int:
        """Takes waiting for their room to arrive."""
        return sum(1 for r in self._rooms.values() if r.waiter is not None)

    def put(self, room: int, handoff: PackedHandoff) -> None:
        """Park a room's KV rows; a take waiting for it gets them. Raises ValueError for a bad
        room id, a room already put or failed, or a handoff that cannot be sent."""
        bad = [name for name, t in handoff.tensors.items() if t.dtype not in DTYPES.values()]
        if bad:
            raise ValueError(f"room {room}: tensors {bad} have dtypes outside {list(DTYPES)}")
        if "tensors" in handoff.header:
            raise ValueError(f"room {room}: the header key 'tensors' is the wire's own")
        json.dumps(handoff.header)  # raises TypeError now rather than at the claim
        self._arrive(room, handoff, None)

    def fail(self, room: int, code: str, message: str) -> None:
        """The prefill could not produce the room: its claimant gets an ERROR frame."""
        self._arrive(room, None, RoomError(code, message))

    def _arrive(self, room: int, handoff: PackedHandoff | None, error: RoomError | None) -> None:
        check_room(room)
        entry = self._rooms.setdefault(room, _Room())
        if entry.arrived:
            raise ValueError(f"room {room} was already put or failed")
        entry.arrived, entry.handoff, entry.error = True, handoff, error
        asyncio.get_running_loop().call_later(self.ttl_s, self._expire, room, entry)
        if entry.waiter is not None and not entry.waiter.done():
            entry.waiter.set_result(None)

    def _expire(self, room: int, entry: _Room) -> None:
        if self._rooms.get(room) is not entry:
            return
        del self._rooms[room]
        if not entry.taken:
            self.expired_total += 1
            log.info("room %d expired unclaimed after %g s", room, self.ttl_s)

    async def take(self, room: int, timeout_s: float) -> PackedHandoff:
        """The room's PackedHandoff, waiting up to `timeout_s` for it to arrive. Raises RoomError:
        "timeout", "taken" (already taken or being taken), or the code given to `fail`. If the
        caller is cancelled before the take returns, the room stays in the table."""
        check_room(room)
        entry = self._rooms.setdefault(room, _Room())
        if entry.taken or entry.waiter is not None:
            raise RoomError("taken", f"room {room} was already claimed")
        if not entry.arrived:
            entry.waiter = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout_s):
                    await entry.waiter
            except TimeoutError:
                if not entry.arrived:  # else it arrived as the deadline passed: take it
                    msg = f"room {room} did not arrive within {timeout_s:g} s"
                    raise RoomError("timeout", msg) from None
            finally:
                entry.waiter = None
                if not entry.arrived and self._rooms.get(room) is entry:
                    del self._rooms[room]
        handoff, error = entry.handoff, entry.error
        entry.taken, entry.handoff, entry.error = True, None, None
        if error is not None:
            raise error
        assert handoff is not None  # arrived with either a handoff or an error
        return handoff
