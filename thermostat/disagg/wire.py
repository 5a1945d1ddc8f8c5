"""The wire protocol between a prefill's bootstrap server and a decode server: framed messages
carrying a JSON header and raw bytes, over one TCP connection per room.

A frame (integers big-endian):

| bytes      | field         | contents                                            |
|------------|---------------|-----------------------------------------------------|
| 4          | magic         | `b"TKV1"`                                           |
| 1          | type          | `FrameType`                                         |
| 4          | header length | uint32, bytes of the header                         |
| 8          | blob length   | uint64, bytes of the blob                           |
| header len | header        | UTF-8 JSON object                                   |
| blob len   | blob          | raw bytes (the packed tensors of a HANDOFF, else 0) |

| type    | direction         | header                                          | blob         |
|---------|-------------------|-------------------------------------------------|--------------|
| CLAIM   | decode -> prefill | `{"room": int, "claimant": str}`                | empty        |
| HANDOFF | prefill -> decode | the caller's JSON plus `"tensors": [meta, ...]` | tensor bytes |
| ERROR   | prefill -> decode | `{"code": str, "message": str}`                 | empty        |

Tensors in a blob (`pack_tensors` / `unpack_tensors`): each tensor's bytes are its contiguous
elements in the host's byte order (little-endian on every machine we run on), starting at
`offset` (a multiple of `ALIGN`, zero padding between), and its meta is
`{"name", "dtype", "shape", "offset", "nbytes"}` with `nbytes == prod(shape) * itemsize`.

A reader checks the magic, type and both lengths (against its limits) before it reads the body,
so a peer cannot make it allocate more than the limits.
"""

from __future__ import annotations

import asyncio
import enum
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

MAGIC = b"TKV1"
_PREFIX = struct.Struct(">4sBIQ")  # magic, type, header length, blob length
PREFIX_BYTES = _PREFIX.size  # 17
ALIGN = 64  # byte alignment of each tensor inside a blob
_CHUNK = 1 << 22  # bytes per read or write of a blob (bounds the stream buffers)
_ZEROS = bytes(ALIGN)

Buffer = bytes | bytearray | memoryview

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "uint8": torch.uint8,  # also fp8 rows, stored as their bytes
    "int64": torch.int64,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class FrameType(enum.IntEnum):
    CLAIM = 1
    HANDOFF = 2
    ERROR = 3


class WireError(Exception):
    """The bytes from the peer are not a valid frame (or not valid tensors)."""


class PeerGone(WireError):
    """The stream ended before a whole frame arrived: `received` of `expected` bytes of the frame
    (`expected` counts the body only once the prefix has arrived)."""

    def __init__(self, received: int, expected: int) -> None:
        super().__init__(f"the stream ended after {received} of {expected} bytes of a frame")
        self.received = received
        self.expected = expected


@dataclass(frozen=True)
class Frame:
    type: FrameType
    header: dict[str, Any]
    blob: Buffer  # a bytearray when read by `read_frame`


def encode_frame(
    type: FrameType, header: dict[str, Any], blob: Buffer | Sequence[Buffer] = b""
) -> list[bytes | memoryview]:
    """The pieces of one frame, to be written in order. `blob` may be one buffer or a sequence of
    pieces (as `pack_tensors` returns), which are not copied."""
    pieces = [blob] if isinstance(blob, bytes | bytearray | memoryview) else list(blob)
    views = [memoryview(p).cast("B") for p in pieces]
    head = json.dumps(header, separators=(",", ":")).encode()
    blob_len = sum(v.nbytes for v in views)
    out: list[bytes | memoryview] = [_PREFIX.pack(MAGIC, type, len(head), blob_len) + head]
    out.extend(v for v in views if v.nbytes)
    return out


async def write_frame(
    writer: asyncio.StreamWriter,
    type: FrameType,
    header: dict[str, Any],
    blob: Buffer | Sequence[Buffer] = b"",
) -> None:
    """Write one frame and drain. Large pieces go in chunks of `_CHUNK` bytes, draining after each,
    so the transport never buffers a copy of a whole blob."""
    for piece in encode_frame(type, header, blob):
        view = memoryview(piece)
        for start in range(0, len(view), _CHUNK):
            writer.write(view[start : start + _CHUNK])
            await writer.drain()


async def read_frame(
    reader: asyncio.StreamReader, max_header_bytes: int = 1 << 20, max_blob_bytes: int = 1 << 36
) -> Frame:
    """Read one frame. Raises PeerGone if the stream ends before the frame does, WireError if the
    prefix is invalid (checked before the body is read) or the header is not a JSON object."""
    try:
        prefix = await reader.readexactly(PREFIX_BYTES)
    except asyncio.IncompleteReadError as e:
        raise PeerGone(len(e.partial), PREFIX_BYTES) from None
    magic, type_value, header_len, blob_len = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r} (expected {MAGIC!r})")
    try:
        frame_type = FrameType(type_value)
    except ValueError:
        raise WireError(f"unknown frame type {type_value}") from None
    if header_len > max_header_bytes:
        raise WireError(f"header of {header_len} bytes is over the limit of {max_header_bytes}")
    if blob_len > max_blob_bytes:
        raise WireError(f"blob of {blob_len} bytes is over the limit of {max_blob_bytes}")
    expected = PREFIX_BYTES + header_len + blob_len
    try:
        head = await reader.readexactly(header_len)
    except asyncio.IncompleteReadError as e:
        raise PeerGone(PREFIX_BYTES + len(e.partial), expected) from None
    try:
        header = json.loads(head)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise WireError(f"header is a JSON {type_name(header)}, not an object")
    blob = bytearray(blob_len)
    view = memoryview(blob)
    got = 0
    while got < blob_len:
        chunk = await reader.read(min(blob_len - got, _CHUNK))
        if not chunk:
            raise PeerGone(PREFIX_BYTES + header_len + got, expected)
        view[got : got + len(chunk)] = chunk
        got += len(chunk)
    return Frame(frame_type, header, blob)


def type_name(value: object) -> str:
    """The JSON name of a decoded JSON value's type, for messages."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def pack_tensors(tensors: dict[str, torch.Tensor]) -> tuple[list[dict[str, Any]], list[memoryview]]:
    """The meta of each tensor and the blob's pieces, in order. Contiguous CPU tensors are viewed,
    not copied (each piece keeps its tensor alive); others are copied once to contiguous CPU."""
    meta: list[dict[str, Any]] = []
    pieces: list[memoryview] = []
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, not one of {list(DTYPES)}")
        pad = -offset % ALIGN
        if pad:
            pieces.append(memoryview(_ZEROS)[:pad])
            offset += pad
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        piece = data.numpy().data  # a memoryview of the tensor's bytes
        meta.append(
            {
                "name": name,
                "dtype": _DTYPE_NAMES[tensor.dtype],
                "shape": list(tensor.shape),
                "offset": offset,
                "nbytes": piece.nbytes,
            }
        )
        if piece.nbytes:
            pieces.append(piece)
        offset += piece.nbytes
    return meta, pieces


def unpack_tensors(meta: list[dict[str, Any]], blob: Buffer) -> dict[str, torch.Tensor]:
    """The tensors that `meta` describes in `blob`. They share memory with a writable blob (and
    keep it alive: `torch.frombuffer` holds a reference), so they stay valid after the caller drops
    the blob, which must not be modified or resized; a read-only blob is copied once first.
    Raises WireError if the meta does not describe tensors inside the blob."""
    view = memoryview(blob).cast("B")
    buffer: bytearray | memoryview = bytearray(view) if view.readonly else view
    if not isinstance(meta, list):
        raise WireError(f"tensor meta is a JSON {type_name(meta)}, not an array")
    out: dict[str, torch.Tensor] = {}
    for item in meta:
        name, dtype, shape, offset, nbytes = _check_meta(item, len(view))
        if name in out:
            raise WireError(f"tensor {name!r} appears twice")
        if nbytes == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
        out[name] = flat.view(dtype).reshape(shape)
    return out


def _check_meta(item: Any, blob_len: int) -> tuple[str, torch.dtype, list[int], int, int]:
    if not isinstance(item, dict):
        raise WireError(f"tensor meta entry is a JSON {type_name(item)}, not an object")
    name, dtype_name = item.get("name"), item.get("dtype")
    shape, offset, nbytes = item.get("shape"), item.get("offset"), item.get("nbytes")
    if not isinstance(name, str):
        raise WireError(f"tensor meta entry without a string name: {item}")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise WireError(f"tensor {name!r} has dtype {dtype_name!r}, not one of {list(DTYPES)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise WireError(f"tensor {name!r} has shape {shape!r}, not a list of counts")
    if not _is_count(offset) or not _is_count(nbytes):
        raise WireError(f"tensor {name!r} has offset {offset!r} and nbytes {nbytes!r}")
    dtype = DTYPES[dtype_name]
    if nbytes != math.prod(shape) * dtype.itemsize:
        raise WireError(f"tensor {name!r}: {nbytes} bytes do not hold {dtype_name} {shape}")
    if offset + nbytes > blob_len:
        raise WireError(
            f"tensor {name!r}: bytes {offset}..{offset + nbytes} of a {blob_len}-byte blob"
        )
    return name, dtype, shape, offset, nbytes


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
