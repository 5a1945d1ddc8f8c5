"""Both ends of a room's handoff: the prefill parks a prompt's KV rows in its `RoomTable`, and the
decode server `claim`s them from the prefill's `BootstrapServer` over TCP.

A room id is an int in [0, 2**63), chosen by the router; the prefill and the decode server both
receive it with the request. One connection carries one room:

    decode                                   prefill (BootstrapServer)
    connect(host, bootstrap port)  ------->  accept
    CLAIM {"room", "claimant"}     ------->  RoomTable.take(room): waits until put / fail
                                   <-------  HANDOFF {header, "tensors": meta} + blob
                                             or ERROR {"code", "message"}
    close                                    close

A room is taken at most once. While the prefill waits for a room, a claimant that disconnects
(or sends anything after its CLAIM) gives the claim up and the room stays in the table for
another claim; once the room is taken, a failed send loses it.

Error codes of `RoomError`:

| code        | raised by   | meaning                                                         |
|-------------|-------------|-----------------------------------------------------------------|
| timeout     | take, claim | the room did not arrive in time (also the prefill's "timeout")  |
| taken       | take        | the room was already claimed, or is being claimed               |
| unreachable | claim       | could not connect to the bootstrap server                       |
| peer_gone   | claim       | the connection closed or failed mid-exchange                    |
| refused     | claim       | the prefill answered ERROR; its code is in `.remote_code`       |
| protocol    | claim       | the prefill's answer is not a valid frame or valid tensors      |
| (any)       | take        | the code that the prefill passed to `RoomTable.fail`            |
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from thermostat.disagg.wire import (
    DTYPES,
    FrameType,
    PeerGone,
    WireError,
    pack_tensors,
    read_frame,
    unpack_tensors,
    write_frame,
)

log = logging.getLogger("thermostat.disagg")
MAX_ROOM = 1 << 63  # room ids are in [0, MAX_ROOM)
_MAX_CLAIM_BYTES = 1 << 16  # header bytes of a CLAIM frame
_STREAM_LIMIT = 1 << 22  # StreamReader buffer of the decode side (bytes)


@dataclass(frozen=True)
class Handoff:
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


def _check_room(room: object) -> None:
    if not is_room(room):
        raise ValueError(f"room id {room!r} is not an integer in [0, 2**63)")


@dataclass
class _Room:
    """One room id in the table. `arrived` is set once, by put or fail, which also start the
    expiry timer that removes the entry whatever it then holds; `taken` is set by the take that
    gets it, after which the entry is a tombstone that refuses other takes."""

    arrived: bool = False
    taken: bool = False
    handoff: Handoff | None = None  # until taken
    error: RoomError | None = None  # from fail, until taken
    waiter: asyncio.Future[None] | None = None  # a take waiting for the room to arrive
    expiry: asyncio.TimerHandle | None = None


class RoomTable:
    """The prefill's rooms, from put (or fail) until a claim takes them or they expire.

    | entry       | holds                         | leaves                                      |
    |-------------|-------------------------------|---------------------------------------------|
    | waiting     | a take that came first        | when the take gives up (timeout, cancelled) |
    | parked      | a Handoff, or fail's error    | (taken)                                     |
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
        """Rooms holding a Handoff that no claim has taken yet."""
        return sum(1 for r in self._rooms.values() if r.handoff is not None)

    @property
    def bytes_parked(self) -> int:
        return sum(r.handoff.nbytes for r in self._rooms.values() if r.handoff is not None)

    @property
    def num_waiting(self) -> int:
        """Takes waiting for their room to arrive."""
        return sum(1 for r in self._rooms.values() if r.waiter is not None)

    def put(self, room: int, handoff: Handoff) -> None:
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

    def _arrive(self, room: int, handoff: Handoff | None, error: RoomError | None) -> None:
        _check_room(room)
        entry = self._rooms.setdefault(room, _Room())
        if entry.arrived:
            raise ValueError(f"room {room} was already put or failed")
        entry.arrived, entry.handoff, entry.error = True, handoff, error
        loop = asyncio.get_running_loop()
        entry.expiry = loop.call_later(self.ttl_s, self._expire, room, entry)
        if entry.waiter is not None and not entry.waiter.done():
            entry.waiter.set_result(None)

    def _expire(self, room: int, entry: _Room) -> None:
        if self._rooms.get(room) is not entry:
            return
        del self._rooms[room]
        if not entry.taken:
            self.expired_total += 1
            log.info("room %d expired unclaimed after %g s", room, self.ttl_s)

    async def take(self, room: int, timeout_s: float) -> Handoff:
        """The room's Handoff, waiting up to `timeout_s` for it to arrive. Raises RoomError:
        "timeout", "taken" (already taken or being taken), or the code given to `fail`. If the
        caller is cancelled before the take returns, the room stays in the table."""
        _check_room(room)
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


class BootstrapServer:
    """The prefill's TCP endpoint: each connection claims one room from `table` and gets its
    HANDOFF (or an ERROR), then the server closes it. A claim waits up to `claim_timeout_s` for
    the room; the CLAIM frame itself must arrive within `read_timeout_s` of connecting. A bad
    connection costs one log line; the server keeps serving."""

    def __init__(
        self, table: RoomTable, claim_timeout_s: float, read_timeout_s: float = 10.0
    ) -> None:
        self.table = table
        self.claim_timeout_s = claim_timeout_s
        self.read_timeout_s = read_timeout_s
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # connection handlers
        self._closed = False

    @property
    def port(self) -> int:
        """The bound port (of the first socket: bind one host), also after `close`."""
        if self._port is None:
            raise RuntimeError("the bootstrap server has not started")
        return self._port

    @property
    def num_connections(self) -> int:
        return len(self._tasks)

    async def start(self, host: str, port: int) -> None:
        """Listen on host:port (port 0: any free port, then see `.port`)."""
        self._server = await asyncio.start_server(self._serve, host, port)
        self._port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening and end every open connection (their claims give up)."""
        self._closed = True
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self._closed:  # accepted just before close
            writer.close()
            return
        self._tasks.add(task)
        peer = _peer_name(writer)
        try:
            await self._exchange(reader, writer, peer)
        except PeerGone as e:
            # smg probes the port at registration: a connection that sends nothing is no fault
            level = logging.DEBUG if e.received == 0 else logging.WARNING
            log.log(level, "bootstrap: dropped the connection from %s: %s", peer, _describe(e))
        except (WireError, OSError, TimeoutError) as e:
            log.warning("bootstrap: dropped the connection from %s: %s", peer, _describe(e))
        except Exception:
            log.exception("bootstrap: the connection from %s failed", peer)
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _exchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str
    ) -> None:
        async with asyncio.timeout(self.read_timeout_s):
            frame = await read_frame(reader, max_header_bytes=_MAX_CLAIM_BYTES, max_blob_bytes=0)
        room, claimant = frame.header.get("room"), frame.header.get("claimant")
        if frame.type != FrameType.CLAIM or not is_room(room) or not isinstance(claimant, str):
            header = json.dumps(frame.header)[:200]
            message = f"expected a CLAIM with a room id in [0, 2**63) and a claimant, not {header}"
            log.warning("bootstrap: bad claim from %s: %s %s", peer, frame.type.name, header)
            await _send_error(writer, "protocol", message)
            return
        who = f"{claimant!r} at {peer}"
        try:
            handoff = await self._take(reader, room, who)
        except RoomError as e:
            log.info("bootstrap: room %d refused to %s: %s (%s)", room, who, e.message, e.code)
            await _send_error(writer, e.code, e.message)
            return
        if handoff is None:
            return
        meta, pieces = pack_tensors(handoff.tensors)
        try:
            await write_frame(
                writer, FrameType.HANDOFF, {**handoff.header, "tensors": meta}, pieces
            )
        except OSError as e:
            log.warning("bootstrap: room %d is lost: %s went away (%s)", room, who, _describe(e))
            return
        log.debug("bootstrap: room %d (%d bytes) sent to %s", room, handoff.nbytes, who)

    async def _take(self, reader: asyncio.StreamReader, room: int, who: str) -> Handoff | None:
        """The room, or None if the claimant went away (or sent more bytes) while the take waited;
        the room then stays in the table."""
        take = asyncio.ensure_future(self.table.take(room, self.claim_timeout_s))
        gone = asyncio.ensure_future(reader.read(1))
        try:
            await asyncio.wait({take, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # the loser, or both if this task is cancelled
            take.cancel()
            gone.cancel()
        if gone.done() and not gone.cancelled():
            gone.exception()  # retrieved: a reset connection is just gone
        if take.cancelled() or not take.done():
            await asyncio.wait({take})  # its cleanup: the room stays parked
            log.info("bootstrap: %s went away while waiting for room %d", who, room)
            return None
        return take.result()


async def _send_error(writer: asyncio.StreamWriter, code: str, message: str) -> None:
    await write_frame(writer, FrameType.ERROR, {"code": code, "message": message})


async def claim(
    host: str,
    port: int,
    room: int,
    claimant: str,
    timeout_s: float,
    connect_timeout_s: float = 5.0,
) -> Handoff:
    """Claim `room` from the prefill's bootstrap server at host:port (decode side). `timeout_s`
    bounds the whole exchange after connecting: waiting for the room and receiving it. Raises
    RoomError (codes in the module docstring), or ValueError for a bad room id; the connection is
    closed on every path, cancellation included."""
    _check_room(room)
    where = f"{host}:{port}"
    try:
        async with asyncio.timeout(connect_timeout_s):
            reader, writer = await asyncio.open_connection(host, port, limit=_STREAM_LIMIT)
    except TimeoutError:
        msg = f"no prefill bootstrap server answered at {where} within {connect_timeout_s:g} s"
        raise RoomError("unreachable", msg) from None
    except OSError as e:
        msg = f"no prefill bootstrap server at {where} ({_describe(e)})"
        raise RoomError("unreachable", msg) from None
    try:
        return await _claim(reader, writer, where, room, claimant, timeout_s)
    finally:
        writer.close()


async def _claim(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    where: str,
    room: int,
    claimant: str,
    timeout_s: float,
) -> Handoff:
    try:
        async with asyncio.timeout(timeout_s):
            await write_frame(writer, FrameType.CLAIM, {"room": room, "claimant": claimant})
            frame = await read_frame(reader)
    except TimeoutError:
        msg = f"room {room} did not arrive from {where} within {timeout_s:g} s"
        raise RoomError("timeout", msg) from None
    except PeerGone as e:
        msg = (
            f"the prefill at {where} closed the connection after {e.received} of {e.expected}"
            f" bytes of room {room}"
        )
        raise RoomError("peer_gone", msg) from None
    except WireError as e:
        msg = f"the prefill at {where} sent garbage for room {room}: {e}"
        raise RoomError("protocol", msg) from None
    except OSError as e:
        msg = f"the connection to the prefill at {where} failed during room {room} ({_describe(e)})"
        raise RoomError("peer_gone", msg) from None
    if frame.type == FrameType.ERROR:
        code, message = str(frame.header.get("code")), str(frame.header.get("message"))
        local_code = "timeout" if code == "timeout" else "refused"
        msg = f"the prefill at {where} refused room {room}: {message} ({code})"
        raise RoomError(local_code, msg, remote_code=code)
    header = dict(frame.header)
    meta = header.pop("tensors", None)
    try:
        if frame.type != FrameType.HANDOFF:
            raise WireError(f"a {frame.type.name} frame instead of a HANDOFF")
        tensors = unpack_tensors(meta, frame.blob)
    except WireError as e:
        msg = f"the prefill at {where} sent garbage for room {room}: {e}"
        raise RoomError("protocol", msg) from None
    return Handoff(header, tensors)


def _peer_name(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)


def _describe(e: BaseException) -> str:
    """A short reason for a connection error ("connection refused", "timed out", ...)."""
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, TimeoutError):
        return "timed out"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror.lower()
    return str(e) or type(e).__name__
