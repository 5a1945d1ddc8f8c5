"""Tests for the disaggregation transport: frames and tensors (thermostat.disagg.wire), the room
table, and claims over loopback TCP (thermostat.disagg.bootstrap). Every test is bounded by
`run`'s timeout; servers bind 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import gc
import socket
import struct
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch

from tests.waiting import HANG_GUARD_S, hang, until
from thermostat.disagg.bootstrap import BootstrapServer, claim
from thermostat.disagg.rooms import PackedHandoff, RoomError, RoomTable
from thermostat.disagg.wire import (
    ALIGN,
    MAGIC,
    PREFIX_BYTES,
    FrameType,
    PeerGone,
    WireError,
    encode_frame,
    pack_tensors,
    read_frame,
    unpack_tensors,
)

HOST = "127.0.0.1"


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Runs `coro` to its end, under a hang guard."""

    async def bounded() -> Any:
        scope = asyncio.timeout(HANG_GUARD_S)
        try:
            async with scope:
                return await coro
        except TimeoutError:
            if scope.expired():
                raise AssertionError(hang("the test's coroutine ending")) from None
            raise

    return asyncio.run(bounded())


def stream_of(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def bf16_all_bits() -> torch.Tensor:
    """Every bfloat16 bit pattern (NaNs, infinities, subnormals, -0) as a (256, 256) tensor."""
    return (
        torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32)
        .to(torch.int16)
        .view(torch.bfloat16)
        .reshape(256, 256)
    )


def kv(seed: int, rows: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "k": torch.randn(2, rows, 8, generator=g).to(torch.bfloat16),
        "v": torch.randn(2, rows, 8, generator=g).to(torch.bfloat16),
        "k_fp8": torch.randint(0, 256, (rows, 8), dtype=torch.uint8, generator=g),
        "scale": torch.rand(2, generator=g),
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert same(got[name], want[name]), name


@asynccontextmanager
async def serving(
    table: RoomTable | None = None,
    claim_timeout_s: float = HANG_GUARD_S,
    read_timeout_s: float = HANG_GUARD_S,
) -> AsyncIterator[BootstrapServer]:
    """A bootstrap server on loopback; its timeouts are hang guards unless a test sets one."""
    server = BootstrapServer(table or RoomTable(), claim_timeout_s, read_timeout_s)
    await server.start(HOST, 0)
    try:
        yield server
    finally:
        await server.close()
        assert server.num_connections == 0


@asynccontextmanager
async def fake_server(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Coroutine[Any, Any, None]],
) -> AsyncIterator[int]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, HOST, 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def raw_exchange(port: int, data: bytes, eof: bool = False) -> bytes:
    """Send raw bytes to a server (then EOF if `eof`) and read everything until it closes."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(data)
        if eof:
            writer.write_eof()
        await writer.drain()
        return await reader.read()
    finally:
        writer.close()


# --- frames -------------------------------------------------------------------------------------


def test_frame_round_trip() -> None:
    header = {"room": 7, "claimant": "decode-0", "nested": {"a": [1, 2.5, None]}, "u": "é"}
    pieces: list[bytes | bytearray | memoryview] = [b"abc", memoryview(b"defgh"), bytearray(b"ij")]
    data = b"".join(encode_frame(FrameType.HANDOFF, header, pieces))
    data += b"".join(encode_frame(FrameType.ERROR, {"code": "x", "message": "y"}))
    data += b"".join(encode_frame(FrameType.CLAIM, {}, b"one blob"))

    async def main() -> None:
        reader = stream_of(data)
        first = await read_frame(reader)
        assert (first.type, first.header, bytes(first.blob)) == (
            FrameType.HANDOFF,
            header,
            b"abcdefghij",
        )
        second = await read_frame(reader)
        assert (second.type, second.header, bytes(second.blob)) == (
            FrameType.ERROR,
            {"code": "x", "message": "y"},
            b"",
        )
        third = await read_frame(reader)
        assert (third.type, third.header, bytes(third.blob)) == (FrameType.CLAIM, {}, b"one blob")
        with pytest.raises(PeerGone):
            await read_frame(reader)

    run(main())


def test_frame_layout() -> None:
    head, blob = encode_frame(FrameType.HANDOFF, {"a": 1}, b"xyz")
    assert head[:4] == MAGIC
    assert struct.unpack(">BIQ", head[4:PREFIX_BYTES]) == (2, len(b'{"a":1}'), 3)
    assert bytes(head[PREFIX_BYTES:]) == b'{"a":1}'
    assert bytes(blob) == b"xyz"


def test_partial_reads() -> None:
    tensors = kv(0)
    meta, pieces = pack_tensors(tensors)
    data = b"".join(encode_frame(FrameType.HANDOFF, {"tensors": meta}, pieces))

    async def main() -> None:
        reader = asyncio.StreamReader()

        async def feed() -> None:
            for i in range(0, len(data), 7):
                reader.feed_data(data[i : i + 7])
                await asyncio.sleep(0)
            reader.feed_eof()

        feeder = asyncio.create_task(feed())
        frame = await read_frame(reader)
        await feeder
        assert frame.header == {"tensors": meta}
        assert_same_tensors(unpack_tensors(frame.header["tensors"], frame.blob), tensors)

    run(main())


@pytest.mark.parametrize("part", ["empty", "prefix", "header", "blob"])
def test_truncated_frame_raises_peer_gone(part: str) -> None:
    data = b"".join(encode_frame(FrameType.HANDOFF, {"k": "v" * 10}, bytes(range(100))))
    cut = {"empty": 0, "prefix": 5, "header": PREFIX_BYTES + 3, "blob": len(data) - 40}[part]

    async def main() -> None:
        with pytest.raises(PeerGone) as info:
            await read_frame(stream_of(data[:cut]))
        assert info.value.received == cut
        assert info.value.expected == (PREFIX_BYTES if cut < PREFIX_BYTES else len(data))
        assert f"after {cut} of {info.value.expected} bytes" in str(info.value)

    run(main())


@pytest.mark.parametrize(
    ("prefix", "match"),
    [
        (b"XKV1" + struct.pack(">BIQ", 1, 2, 0), "bad magic"),
        (MAGIC + struct.pack(">BIQ", 9, 2, 0), "unknown frame type 9"),
        (MAGIC + struct.pack(">BIQ", 2, 2000, 0), "header of 2000 bytes"),
        (MAGIC + struct.pack(">BIQ", 2, 2, 1 << 40), "blob of 1099511627776 bytes"),
    ],
)
def test_bad_prefix_raises_before_the_body(prefix: bytes, match: str) -> None:
    async def main() -> None:
        # No body and no EOF: reading the body would hang until run's timeout.
        reader = stream_of(prefix, eof=False)
        with pytest.raises(WireError, match=match):
            await read_frame(reader, max_header_bytes=1000, max_blob_bytes=1 << 30)

    run(main())


@pytest.mark.parametrize(
    ("header", "match"),
    [(b"[1, 2]", "JSON array, not an object"), (b"{bad", "not valid JSON"), (b"\xff{}", "JSON")],
)
def test_header_must_be_a_json_object(header: bytes, match: str) -> None:
    data = MAGIC + struct.pack(">BIQ", 1, len(header), 0) + header

    async def main() -> None:
        with pytest.raises(WireError, match=match):
            await read_frame(stream_of(data))

    run(main())


# --- tensors ------------------------------------------------------------------------------------


def test_tensor_round_trip() -> None:
    g = torch.Generator().manual_seed(1)
    tensors = {
        "bf16": bf16_all_bits(),
        "fp16": torch.randn(3, 7, generator=g).half(),
        "fp32": torch.randn(5, generator=g),
        "fp8_rows": torch.randint(0, 256, (4, 3, 5), dtype=torch.uint8, generator=g),
        "positions": torch.arange(11, dtype=torch.int64),
        "empty": torch.empty(0, 8, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "transposed": torch.randn(4, 6, generator=g).t(),  # not contiguous: copied once
    }
    meta, pieces = pack_tensors(tensors)
    assert [m["name"] for m in meta] == list(tensors)
    assert all(m["offset"] % ALIGN == 0 for m in meta)
    assert meta[0] == {
        "name": "bf16",
        "dtype": "bfloat16",
        "shape": [256, 256],
        "offset": 0,
        "nbytes": 1 << 17,
    }
    blob = bytearray(b"".join(pieces))
    got = unpack_tensors(meta, blob)
    assert_same_tensors(got, tensors)
    assert torch.isnan(got["bf16"].float()).sum() == torch.isnan(tensors["bf16"].float()).sum()

    # The tensors alias the blob (no copy) and keep it alive.
    blob[meta[2]["offset"] : meta[2]["offset"] + 4] = struct.pack("<f", 42.0)
    assert got["fp32"][0].item() == 42.0
    del blob
    gc.collect()
    assert_same_tensors({"bf16": got["bf16"]}, {"bf16": tensors["bf16"]})


def test_pack_does_not_copy_contiguous_tensors() -> None:
    t = torch.zeros(4, dtype=torch.float32)
    _, pieces = pack_tensors({"t": t})
    t[0] = 1.0
    assert bytes(pieces[0][:4]) == struct.pack("<f", 1.0)
    del t
    gc.collect()
    assert bytes(pieces[0]) == struct.pack("<4f", 1.0, 0.0, 0.0, 0.0)  # the piece keeps it alive


def test_unpack_copies_a_read_only_blob() -> None:
    meta, pieces = pack_tensors({"x": torch.arange(6, dtype=torch.int64)})
    got = unpack_tensors(meta, b"".join(pieces))  # bytes: read-only
    assert got["x"].tolist() == list(range(6))


def test_pack_rejects_unsupported_dtypes() -> None:
    with pytest.raises(ValueError, match="int32"):
        pack_tensors({"x": torch.zeros(2, dtype=torch.int32)})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"dtype": "int32"}, "dtype 'int32'"),
        ({"dtype": None}, "dtype None"),
        ({"name": 3}, "string name"),
        ({"shape": [2, -1]}, "shape"),
        ({"shape": "2,3"}, "shape"),
        ({"offset": True}, "offset"),
        ({"nbytes": 6}, "do not hold"),
        ({"shape": [2, 4]}, "do not hold"),
        ({"offset": 80}, "bytes 80..104 of a 96-byte blob"),
    ],
)
def test_unpack_rejects_bad_meta(change: dict[str, Any], match: str) -> None:
    meta, pieces = pack_tensors({"x": torch.zeros(2, 3, dtype=torch.float32)})
    blob = bytearray(b"".join(pieces)) + bytearray(72)  # 96 bytes
    with pytest.raises(WireError, match=match):
        unpack_tensors([{**meta[0], **change}], blob)


def test_unpack_rejects_bad_meta_lists() -> None:
    meta, pieces = pack_tensors({"x": torch.zeros(2)})
    blob = bytearray(b"".join(pieces))
    with pytest.raises(WireError, match="twice"):
        unpack_tensors(meta + meta, blob)
    with pytest.raises(WireError, match="not an array"):
        unpack_tensors({"x": meta[0]}, blob)  # type: ignore[arg-type]
    with pytest.raises(WireError, match="not an object"):
        unpack_tensors([1], blob)  # type: ignore[list-item]


# --- room table ---------------------------------------------------------------------------------


def test_room_table_rejects_bad_puts() -> None:
    async def main() -> None:
        table = RoomTable()
        handoff = PackedHandoff({}, kv(0))
        for room in (-1, 1 << 63, True, "7", 1.0):
            with pytest.raises(ValueError, match="room id"):
                table.put(room, handoff)  # type: ignore[arg-type]
        table.put((1 << 63) - 1, handoff)
        with pytest.raises(ValueError, match="already"):
            table.put((1 << 63) - 1, handoff)
        with pytest.raises(ValueError, match="already"):
            table.fail((1 << 63) - 1, "oom", "out of memory")
        with pytest.raises(ValueError, match="'tensors'"):
            table.put(1, PackedHandoff({"tensors": []}, {}))
        with pytest.raises(ValueError, match="dtypes"):
            table.put(1, PackedHandoff({}, {"x": torch.zeros(1, dtype=torch.int32)}))
        with pytest.raises(TypeError):
            table.put(1, PackedHandoff({"x": object()}, {}))
        assert table.num_parked == 1

    run(main())


def test_room_table_expires_unclaimed_rooms() -> None:
    async def main() -> None:
        table = RoomTable(ttl_s=0.05)
        handoff = PackedHandoff({"n": 1}, kv(0))
        table.put(1, handoff)
        table.put(2, PackedHandoff({}, kv(1)))
        table.fail(3, "oom", "out of memory")
        assert (table.num_parked, table.bytes_parked) == (2, 2 * handoff.nbytes)
        assert (await table.take(2, 1.0)).header == {}
        await until(lambda: table.expired_total == 2, "rooms 1 and 3 expiring")  # 2 was taken
        assert (table.num_parked, table.bytes_parked) == (0, 0)
        with pytest.raises(RoomError) as info:
            await table.take(1, 0.01)  # expired: as if it never came
        assert info.value.code == "timeout"

    run(main())


def test_a_cancelled_take_leaves_the_room() -> None:
    async def main() -> None:
        table = RoomTable()
        waiting = asyncio.create_task(table.take(5, HANG_GUARD_S))
        await until(lambda: table.num_waiting == 1)
        waiting.cancel()
        await asyncio.wait({waiting})
        assert table.num_waiting == 0
        table.put(5, PackedHandoff({"ok": True}, {}))
        assert (await table.take(5, 1.0)).header == {"ok": True}
        with pytest.raises(RoomError) as info:
            await table.take(5, 1.0)
        assert info.value.code == "taken"

    run(main())


# --- claims over loopback -----------------------------------------------------------------------


def test_put_then_claim() -> None:
    async def main() -> None:
        table = RoomTable()
        tensors = kv(3) | {"big": torch.randint(0, 256, (10 << 20,), dtype=torch.uint8)}
        table.put(42, PackedHandoff({"num_tokens": 5, "first_token": 17}, tensors))
        async with serving(table) as server:
            got = await claim(HOST, server.port, 42, "decode-0", timeout_s=HANG_GUARD_S)
        assert got.header == {"num_tokens": 5, "first_token": 17}
        assert_same_tensors(got.tensors, tensors)
        assert got.nbytes == PackedHandoff({}, tensors).nbytes
        assert (table.num_parked, table.bytes_parked) == (0, 0)

    run(main())


def test_claim_before_put_waits() -> None:
    async def main() -> None:
        table = RoomTable()
        async with serving(table) as server:
            claiming = asyncio.create_task(claim(HOST, server.port, 9, "d", timeout_s=HANG_GUARD_S))
            await until(lambda: table.num_waiting == 1)
            tensors = kv(9)
            table.put(9, PackedHandoff({"late": True}, tensors))
            got = await claiming
        assert got.header == {"late": True}
        assert_same_tensors(got.tensors, tensors)

    run(main())


def test_concurrent_claims() -> None:
    async def main() -> None:
        table = RoomTable()
        rooms = [(1 << 62) + i for i in range(8)]
        for room in rooms[:4]:
            table.put(room, PackedHandoff({"room": room}, kv(room % 100)))
        loop = asyncio.get_running_loop()
        for room in rooms[4:]:
            loop.call_later(0.05, table.put, room, PackedHandoff({"room": room}, kv(room % 100)))
        async with serving(table) as server:
            got = await asyncio.gather(
                *(
                    claim(HOST, server.port, room, f"d{room}", timeout_s=HANG_GUARD_S)
                    for room in rooms
                )
            )
        for room, handoff in zip(rooms, got, strict=True):
            assert handoff.header == {"room": room}
            assert_same_tensors(handoff.tensors, kv(room % 100))
        assert table.num_parked == 0

    run(main())


def test_failed_room_is_refused() -> None:
    async def main() -> None:
        table = RoomTable()
        table.fail(11, "oom", "the prompt did not fit in the KV cache")
        async with serving(table) as server:
            with pytest.raises(RoomError) as info:
                await claim(HOST, server.port, 11, "d", timeout_s=HANG_GUARD_S)
        assert (info.value.code, info.value.remote_code) == ("refused", "oom")
        assert "did not fit" in info.value.message
        assert f"{HOST}:{server.port}" in info.value.message and "room 11" in info.value.message

    run(main())


def test_room_failed_while_claimed_is_refused() -> None:
    async def main() -> None:
        table = RoomTable()
        asyncio.get_running_loop().call_later(0.05, table.fail, 12, "aborted", "client left")
        async with serving(table) as server:
            with pytest.raises(RoomError) as info:
                await claim(HOST, server.port, 12, "d", timeout_s=HANG_GUARD_S)
        assert (info.value.code, info.value.remote_code) == ("refused", "aborted")

    run(main())


def test_room_that_never_comes_times_out_on_the_decode_side() -> None:
    async def main() -> None:
        table = RoomTable()
        async with serving(table) as server:
            with pytest.raises(RoomError) as info:
                await claim(HOST, server.port, 13, "d", timeout_s=0.3)
            assert (info.value.code, info.value.remote_code) == ("timeout", None)
            assert (
                info.value.message
                == f"room 13 did not arrive from {HOST}:{server.port} within 0.3 s"
            )
            await until(lambda: table.num_waiting == 0)  # the server saw the claimant go

    run(main())


def test_room_that_never_comes_times_out_on_the_prefill_side() -> None:
    async def main() -> None:
        async with serving(claim_timeout_s=0.2) as server:
            with pytest.raises(RoomError) as info:
                await claim(HOST, server.port, 14, "d", timeout_s=HANG_GUARD_S)
        assert (info.value.code, info.value.remote_code) == ("timeout", "timeout")
        assert "room 14" in info.value.message

    run(main())


def test_unreachable() -> None:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]  # closed below: nobody listens there

    async def main() -> None:
        with pytest.raises(RoomError) as info:
            await claim(HOST, port, 1, "d", timeout_s=1.0, connect_timeout_s=1.0)
        assert info.value.code == "unreachable"
        want = f"no prefill bootstrap server at {HOST}:{port} (connection refused)"
        assert info.value.message == want

    run(main())


def test_peer_gone_mid_frame() -> None:
    meta, pieces = pack_tensors(kv(0))
    data = b"".join(encode_frame(FrameType.HANDOFF, {"tensors": meta}, pieces))

    async def half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_frame(reader)
        writer.write(data[: len(data) // 2])
        await writer.drain()

    async def main() -> None:
        async with fake_server(half) as port:
            with pytest.raises(RoomError) as info:
                await claim(HOST, port, 15, "d", timeout_s=HANG_GUARD_S)
        assert info.value.code == "peer_gone"
        want = (
            f"the prefill at {HOST}:{port} closed the connection after {len(data) // 2}"
            f" of {len(data)} bytes of room 15"
        )
        assert info.value.message == want

    run(main())


def test_silent_server_times_out() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the claimant gives up

    async def main() -> None:
        async with fake_server(silent) as port:
            with pytest.raises(RoomError) as info:
                await claim(HOST, port, 16, "d", timeout_s=0.2)
        assert (info.value.code, info.value.remote_code) == ("timeout", None)

    run(main())


def test_garbage_answer_is_a_protocol_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_frame(reader)
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        await writer.drain()

    async def main() -> None:
        async with fake_server(garbage) as port:
            with pytest.raises(RoomError) as info:
                await claim(HOST, port, 17, "d", timeout_s=HANG_GUARD_S)
        assert info.value.code == "protocol"
        assert "bad magic" in info.value.message

    run(main())


def test_expired_rooms_through_the_server() -> None:
    async def main() -> None:
        table = RoomTable(ttl_s=0.05)
        table.put(18, PackedHandoff({}, kv(18)))
        assert table.bytes_parked > 0
        async with serving(table, claim_timeout_s=0.2) as server:
            await until(lambda: table.bytes_parked == 0)
            with pytest.raises(RoomError) as info:
                await claim(HOST, server.port, 18, "d", timeout_s=HANG_GUARD_S)
        assert info.value.code == "timeout"
        assert (table.num_parked, table.expired_total) == (0, 1)

    run(main())


def test_second_claim_is_refused() -> None:
    async def main() -> None:
        table = RoomTable()
        table.put(19, PackedHandoff({}, kv(19)))
        async with serving(table) as server:
            await claim(HOST, server.port, 19, "d0", timeout_s=HANG_GUARD_S)
            with pytest.raises(RoomError) as info:
                await claim(HOST, server.port, 19, "d1", timeout_s=HANG_GUARD_S)
        assert (info.value.code, info.value.remote_code) == ("refused", "taken")

    run(main())


def test_server_survives_garbage() -> None:
    async def main() -> None:
        table = RoomTable()
        table.put(20, PackedHandoff({"ok": 1}, kv(20)))
        async with serving(table, read_timeout_s=0.2) as server:
            port = server.port
            assert await raw_exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") == b""
            oversized = MAGIC + struct.pack(">BIQ", 1, 1 << 30, 0)
            assert await raw_exchange(port, oversized) == b""
            assert await raw_exchange(port, MAGIC, eof=True) == b""  # half a prefix
            # Connects and says nothing: dropped after the read timeout.
            _, idle = await asyncio.open_connection(HOST, port)
            for header in ({"room": -1, "claimant": "d"}, {"room": 20}, {"room": "20"}):
                answer = await raw_exchange(port, b"".join(encode_frame(FrameType.CLAIM, header)))
                frame = await read_frame(stream_of(answer))
                assert (frame.type, frame.header["code"]) == (FrameType.ERROR, "protocol")
            wrong_type = b"".join(encode_frame(FrameType.HANDOFF, {"room": 20, "claimant": "d"}))
            frame = await read_frame(stream_of(await raw_exchange(port, wrong_type)))
            assert frame.header["code"] == "protocol"
            await until(lambda: server.num_connections == 0)
            idle.close()
            got = await claim(HOST, port, 20, "d", timeout_s=HANG_GUARD_S)
        assert got.header == {"ok": 1}

    run(main())


def test_claimant_gone_while_waiting_leaves_the_room() -> None:
    async def main() -> None:
        table = RoomTable()
        async with serving(table) as server:
            # A raw claimant that disconnects while its claim waits.
            _, writer = await asyncio.open_connection(HOST, server.port)
            writer.write(b"".join(encode_frame(FrameType.CLAIM, {"room": 21, "claimant": "x"})))
            await until(lambda: table.num_waiting == 1)
            writer.close()
            await until(lambda: table.num_waiting == 0 and server.num_connections == 0)
            # A cancelled claim (its HTTP client went away) closes its connection.
            claiming = asyncio.create_task(
                claim(HOST, server.port, 21, "y", timeout_s=HANG_GUARD_S)
            )
            await until(lambda: table.num_waiting == 1)
            claiming.cancel()
            await asyncio.wait({claiming})
            await until(lambda: table.num_waiting == 0 and server.num_connections == 0)
            table.put(21, PackedHandoff({"kept": True}, kv(21)))
            got = await claim(HOST, server.port, 21, "z", timeout_s=HANG_GUARD_S)
        assert got.header == {"kept": True}

    run(main())


def test_closing_the_server_ends_waiting_claims() -> None:
    async def main() -> None:
        table = RoomTable()
        server = BootstrapServer(table, claim_timeout_s=HANG_GUARD_S)
        await server.start(HOST, 0)
        claiming = asyncio.create_task(claim(HOST, server.port, 22, "d", timeout_s=HANG_GUARD_S))
        await until(lambda: table.num_waiting == 1)
        await server.close()
        assert server.num_connections == 0 and table.num_waiting == 0
        with pytest.raises(RoomError) as info:
            await claiming
        assert info.value.code == "peer_gone"
        assert "after 0 of 17 bytes of room 22" in info.value.message

    run(main())
