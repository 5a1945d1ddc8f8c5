"""Both ends of a room's handoff over TCP: the prefill parks a prompt's KV rows in its `RoomTable`
(thermostat.disagg.rooms), and the decode server `claim`s them from the prefill's
`BootstrapServer`.

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
from typing import Any

from thermostat.disagg.rooms import PackedHandoff, RoomError, RoomTable, check_room, is_room
from thermostat.disagg.wire import (
    FrameType,
    PeerGone,
    WireError,
    pack_tensors,
    read_frame,
    unpack_tensors,
    write_frame,
)

log = logging.getLogger("thermostat.disagg")
_MAX_CLAIM_BYTES = 1 << 16  # header bytes of a CLAIM frame
_STREAM_LIMIT = 1 << 22  # StreamReader buffer of the decode side (bytes)


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

    async def _take(
        self, reader: asyncio.StreamReader, room: int, who: str
    ) -> PackedHandoff | None:
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
) -> PackedHandoff:
    """Claim `room` from the prefill's bootstrap server at host:port (decode side). `timeout_s`
    bounds the whole exchange after connecting: waiting for the room and receiving it. Raises
    RoomError (codes in the module docstring), or ValueError for a bad room id; the connection is
    closed on every path, cancellation included."""
    check_room(room)
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
) -> PackedHandoff:
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
    return PackedHandoff(header, tensors)


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
