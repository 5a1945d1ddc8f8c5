"""A GGUF tensor's quantized blocks as the kernels' records, exactly: the file's integers, scales
and minimums, no requantization (quant.py's formats).

Every type is read into one form, w = d q + m with q an integer, a float32 d per 16 weights along
K (the finest any type has: Q6_K's sub-blocks) and a float32 m per 32 (-0.0 where the type has
none: adding it leaves every value, the sign of zero included). The integers are unpacked from the
blocks' bytes with the bit layouts of gguf's `dequantize` (`QUANTS`, which the tests check them
against bit for bit); d and m come from the scale fields, multiplied in float32 as gguf does. The
kernels do the same in one pass (`unpack_gguf`, 0.1-0.7 ns a weight where this numpy code takes
1-4 and gguf's float dequantization ~7), and the tests hold them to this code.

| type | w (gguf's dequantize)   | q       | d (per 32 unless said)     | m         | `bits`  |
|------|-------------------------|---------|----------------------------|-----------|---------|
| Q8_0 | d q                     | int8    | d fp16                     | -         | 8       |
| Q5_0 | d (q - 16)              | q - 16  | d fp16                     | -         | 8       |
| Q4_0 | d (q - 8)               | q - 8   | d fp16                     | -         | 4 (z 8) |
| Q4_1 | d q + m                 | 0..15   | d fp16                     | m fp16    | 5       |
| Q4_K | (d sc_j) q - dmin m_j   | 0..15   | d sc_j (up to 17 bits)     | -dmin m_j | 6       |
| Q5_1 | d q + m                 | 0..31   | d fp16                     | m fp16    | 9       |
| Q5_K | (d sc_j) q - dmin m_j   | 0..31   | d sc_j                     | -dmin m_j | 9       |
| Q6_K | (d sc_j) (q - 32)       | q - 32  | d sc_j per 16, sc_j int8   | -         | 9       |
| Q3_K | (d sc_j) q              | q - 4   | d sc_j per 16, sc_j 6-bit  | -         | 9       |
|      |                         | (+4 h)  | minus 32                   |           |         |
| IQ4_NL | d L[q]                | L[q]    | d fp16 (L: IQ4_LEVELS)     | -         | 8       |
| IQ4_XS | (d sc_j) L[q]         | L[q]    | d sc_j, sc_j 6-bit - 32    | -         | 9       |

Rows of different types in one weight (a fused qkv of a Q4_K_M file: Q4_K q and k, Q6_K v) take
the format that holds them all: `bits` 9 holds every type above exactly.

With the kernels, the super-block types (the K-quants and IQ4_XS) keep the file's factored
scales: `bits` 10 for Q4_K (6's values), 12 for IQ4_XS (its 4-bit level indices) and 11 for the
rest and their mixes (9's), the same values in fewer bytes (quant.py). The grid reads each
super-block's d and dmin for them (`supers`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from thermostat.models import quant
from thermostat.models.quant import LEVELS, SUPER, Bits, QuantizedWeight, block_bytes

if TYPE_CHECKING:
    from thermostat.kernels import LinearOps

# byte offsets in a block: (d, m or dmin, K-quant sub-block scales) as (start, length), or None
FIELDS: dict[str, tuple[tuple[int, int] | None, ...]] = {
    "Q8_0": ((0, 2), None, None),
    "Q4_0": ((0, 2), None, None),
    "Q5_0": ((0, 2), None, None),
    "Q4_1": ((0, 2), (2, 2), None),
    "Q5_1": ((0, 2), (2, 2), None),
    "Q4_K": ((0, 2), (2, 2), (4, 12)),
    "Q5_K": ((0, 2), (2, 2), (4, 12)),
    "Q6_K": ((208, 2), None, (192, 16)),
    "Q3_K": ((108, 2), None, (96, 12)),
    "IQ4_NL": ((0, 2), None, None),
    "IQ4_XS": ((0, 2), None, (2, 6)),
}
EXACT_TYPES = tuple(FIELDS)
FLOAT16_INT8 = frozenset({"Q8_0", "Q5_0", "IQ4_NL"})  # int8 q, a float16 d per 32: format 8
# a format whose rows are all of one of these types -> the format (else 8 or 9)
NARROW: dict[frozenset[str], Bits] = {
    frozenset({"Q4_0"}): 4,
    frozenset({"Q4_1"}): 5,
    frozenset({"Q4_K"}): 6,
}
# the types of 256-weight super-blocks, whose d (and dmin) factor every block's scale: rows all of
# them take a super-block format with the kernels (10 for Q4_K alone, 12 for IQ4_XS, else 11)
SUPER_TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K", "Q3_K", "IQ4_XS"})
# IQ4's 16 levels (ggml's kvalues_iq4nl): q is the level its 4-bit index names
IQ4_LEVELS = np.array(quant.IQ4_LEVELS, dtype=np.int8)
# the integers' fields of a block: (byte start, byte end, bytes per run, shifts, mask, place),
# each run of bytes giving its values shifted by each shift in turn (ggml's order: a run's low
# nibbles, then its high ones), masked, then OR-ed in at bit `place` (a second field holds the
# high bits); then an offset
BitField = tuple[int, int, int, tuple[int, ...], int, int]
LOW_HIGH = (0, 4)
EIGHT = tuple(range(8))
CRUMBS = (0, 2, 4, 6)  # a byte's four 2-bit values
QUANTS: dict[str, tuple[tuple[BitField, ...], int]] = {
    "Q4_0": (((2, 18, 16, LOW_HIGH, 15, 0),), -8),
    "Q4_1": (((4, 20, 16, LOW_HIGH, 15, 0),), 0),
    "Q5_0": (((6, 22, 16, LOW_HIGH, 15, 0), (2, 6, 1, EIGHT, 1, 4)), -16),
    "Q5_1": (((8, 24, 16, LOW_HIGH, 15, 0), (4, 8, 1, EIGHT, 1, 4)), 0),
    "Q4_K": (((16, 144, 32, LOW_HIGH, 15, 0),), 0),
    "Q5_K": (((48, 176, 32, LOW_HIGH, 15, 0), (16, 48, 32, EIGHT, 1, 4)), 0),
    "Q6_K": (((0, 128, 64, LOW_HIGH, 15, 0), (128, 192, 32, CRUMBS, 3, 4)), -32),
    # q = low + 4 h - 4: ggml's low - 4 where the mask's bit is 0
    "Q3_K": (((32, 96, 32, CRUMBS, 3, 0), (0, 32, 32, EIGHT, 1, 2)), -4),
    # indices of IQ4_LEVELS
    "IQ4_NL": (((2, 18, 16, LOW_HIGH, 15, 0),), 0),
    "IQ4_XS": (((8, 136, 16, LOW_HIGH, 15, 0),), 0),
}


@dataclass
class BlockGrid:
    """A weight [N, K] as its file stores it: w = d q + m, d per 16 along K, m per 32."""

    qtypes: frozenset[str]  # the GGML types of its rows
    q: torch.Tensor  # [N, K] int8 (every served type's integers fit: Q8_0's widest)
    d: torch.Tensor  # [N, K / 16] float32
    m: torch.Tensor  # [N, K / 32] float32
    supers: torch.Tensor | None = None  # [N, K / 256, 2] float32: d, dmin (SUPER_TYPES)

    @classmethod
    def read(cls, data: np.ndarray, qtype: str, ops: LinearOps | None = None) -> BlockGrid:
        """A tensor's stored blocks [N, bytes per row] (GGUFReader's data) of an EXACT_TYPES
        type; `ops`: the kernels, which unpack them in one pass (`unpack_gguf`: the same
        values)."""
        gtype = GGMLQuantizationType[qtype]
        block, size = GGML_QUANT_SIZES[gtype]
        rows = data.shape[0]
        blocks = np.ascontiguousarray(data).reshape(-1, size)  # [N * blocks per row, size]
        d_at, m_at, scales_at = FIELDS[qtype]
        assert d_at is not None
        supers = None
        if qtype in SUPER_TYPES:
            no_dmin = np.zeros((len(blocks), 1), np.float32)
            dmin = _half(blocks, m_at) if m_at is not None else no_dmin
            supers = torch.from_numpy(np.concatenate([_half(blocks, d_at), dmin], axis=1))
            supers = supers.view(rows, -1, 2)
        if ops is not None:
            with warnings.catch_warnings():  # the file's read-only map: the kernel only reads it
                warnings.filterwarnings("ignore", "The given NumPy array is not writable")
                stored = torch.from_numpy(blocks)
            parts = [t.view(rows, -1) for t in ops.unpack_gguf(stored, gtype.value)]
            return cls(frozenset({qtype}), parts[0], parts[1], parts[2], supers)
        q = integers(blocks, qtype).reshape(rows, -1)
        d = _half(blocks, d_at)  # [blocks, 1]
        m = _half(blocks, m_at) if m_at is not None else np.full_like(d, -0.0)
        if qtype in ("Q4_K", "Q5_K"):
            assert scales_at is not None
            sc, mins = Q4_K.get_scale_min(blocks[:, scales_at[0] : scales_at[0] + 12])
            d, m = d * sc.astype(np.float32), -(m * mins.astype(np.float32))
        elif qtype == "IQ4_XS":
            d = d * _iq4_xs_scales(blocks[:, 2:8]).astype(np.float32)
        elif qtype in ("Q6_K", "Q3_K"):
            sc = _q3_k_scales(blocks[:, 96:108]) if qtype == "Q3_K" else blocks[:, 192:208]
            d = d * sc.view(np.int8).astype(np.float32)
            m = np.full((len(blocks), block // 32), -0.0, dtype=np.float32)
        per_d = block // 16 // d.shape[1]  # 16-weight pieces per d: 2, Q6_K's and Q3_K's 1
        return cls(
            frozenset({qtype}),
            torch.from_numpy(q),
            torch.from_numpy(np.repeat(d, per_d, axis=1).reshape(rows, -1)),
            torch.from_numpy(np.repeat(m, block // 32 // m.shape[1], axis=1).reshape(rows, -1)),
            supers,
        )

    @classmethod
    def cat(cls, parts: list[BlockGrid]) -> BlockGrid:
        """Row blocks of one weight (a fused projection's parts), in order."""
        supers = [p.supers for p in parts if p.supers is not None]
        return cls(
            frozenset().union(*(p.qtypes for p in parts)),
            torch.cat([p.q for p in parts]),
            torch.cat([p.d for p in parts]),
            torch.cat([p.m for p in parts]),
            torch.cat(supers) if len(supers) == len(parts) else None,
        )

    def rows(self, order: torch.Tensor) -> BlockGrid:
        """The grid with its rows reordered (llama.cpp's q / k permutation undone)."""
        supers = None if self.supers is None else self.supers[order]
        return BlockGrid(self.qtypes, self.q[order], self.d[order], self.m[order], supers)

    def dequantize(self) -> torch.Tensor:
        """The weight in float32, d q + m: the values gguf's `dequantize` gives (a product and a
        sum, each rounded once, as its own)."""
        rows, k = self.q.shape
        w = self.q.view(rows, k // 16, 16).float().mul_(self.d.unsqueeze(-1))
        return w.view(rows, k // 32, 32).add_(self.m.unsqueeze(-1)).view(rows, k)

    @classmethod
    def joined(cls, parts: list[BlockGrid], ops: LinearOps | None = None) -> QuantizedWeight:
        """`cat(parts).packed(ops)`, with the kernels each part packed straight into its
        groups of the weight's records (no joined copy of the parts) where every part but the
        last fills whole groups of 64 rows."""
        if ops is None or len(parts) == 1 or any(len(p.q) % 64 for p in parts[:-1]):
            return cls.cat(parts).packed(ops)
        compact = all(p.supers is not None for p in parts)
        bits = record_format(frozenset().union(*(p.qtypes for p in parts)), compact)
        n, k = sum(len(p.q) for p in parts), parts[0].q.shape[1]
        groups, kb = (n + 63) // 64, (k + 31) // 32
        records = torch.empty(groups, kb, block_bytes(bits), dtype=torch.uint8)
        first = 0
        for part in parts:
            last = first + (len(part.q) + 63) // 64
            part.packed(ops, bits, records[first:last])
            first = last
        return QuantizedWeight(bits, n, k, records)

    def packed(
        self,
        ops: LinearOps | None = None,
        bits: Bits | None = None,
        out: torch.Tensor | None = None,
    ) -> QuantizedWeight:
        """The kernels' records in `bits` (default: the narrowest format holding every row
        exactly, `record_format`); `ops`: the kernels, which pack them in one pass, into `out`
        where it is given (`joined`)."""
        bits = bits or record_format(self.qtypes, ops is not None and self.supers is not None)
        per_32 = self.d[:, 0::2]  # the one d of a block (all but Q6_K's, Q3_K's, ...)
        if bits == 8:
            return QuantizedWeight.pack(self.q, per_32.half(), ops=ops, out=out)
        if bits == 4:
            z = torch.full_like(per_32, 8, dtype=torch.int8)
            q = (self.q + 8).to(torch.uint8)
            return QuantizedWeight.pack(q, per_32.half(), z, ops=ops, out=out)
        if bits == 5:
            z = torch.zeros_like(per_32, dtype=torch.int8)
            q, d, m = self.q.view(torch.uint8), per_32.half(), self.m.half()
            return QuantizedWeight.pack(q, d, z, m, ops=ops, out=out)
        supers = self.supers if bits in SUPER else None
        if bits == LEVELS:  # IQ4_XS: no minimums
            return QuantizedWeight.pack(self.q, self.d, None, None, bits, ops, out, supers)
        if bits in (6, 10):
            q4 = self.q.view(torch.uint8)  # 0..15 either way
            d = per_32.contiguous()
            return QuantizedWeight.pack(q4, d, None, self.m, bits, ops, out, supers)
        return QuantizedWeight.pack(self.q, self.d, None, self.m, bits, ops, out, supers)


def record_format(qtypes: frozenset[str], compact: bool = False) -> Bits:
    """The narrowest record format holding rows of all these types exactly (the table); with
    `compact` (the kernels pack it, the rows' super-block scales at hand), a super-block format
    for SUPER_TYPES rows."""
    if compact and qtypes <= SUPER_TYPES:
        return {frozenset({"Q4_K"}): 10, frozenset({"IQ4_XS"}): LEVELS}.get(qtypes, 11)
    return 8 if qtypes <= FLOAT16_INT8 else NARROW.get(qtypes, 9)


def integers(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """The integers q of blocks [B, block bytes] of an EXACT_TYPES type, int8 [B, block size]."""
    if qtype == "Q8_0":
        return np.ascontiguousarray(blocks[:, 2:]).view(np.int8)  # a copy: writable
    fields, offset = QUANTS[qtype]
    q = np.zeros((), dtype=np.uint8)
    for start, end, run, shifts, mask, place in fields:
        runs = blocks[:, start:end].reshape(len(blocks), -1, 1, run)
        values = (runs >> np.array(shifts, dtype=np.uint8).reshape(1, 1, -1, 1)) & np.uint8(mask)
        q = q | (values.reshape(len(blocks), -1) << np.uint8(place))
    if qtype.startswith("IQ4"):
        return IQ4_LEVELS[q]
    return q.view(np.int8) + np.int8(offset) if offset else q.view(np.int8)


def dequantized(data: np.ndarray, qtype: GGMLQuantizationType, rows: int = 4096) -> np.ndarray:
    """gguf's `dequantize` of a tensor's stored rows into one float32 array, `rows` rows at a
    time (its numpy temporaries stay a few MB for the largest tensor, the embeddings)."""
    flat = data.reshape(-1, data.shape[-1])
    first = dequantize(flat[:rows], qtype)
    out = np.empty((len(flat), first.shape[-1]), dtype=np.float32)
    out[: len(first)] = first
    for r in range(rows, len(flat), rows):
        out[r : r + rows] = dequantize(flat[r : r + rows], qtype)
    return out.reshape(*data.shape[:-1], first.shape[-1])


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """A Q3_K block's 16 sub-block scales, 6 bits each in its 12 bytes (the low 4 bits in bytes
    0-7, two to a byte; the high 2 in bytes 8-11, four to a byte), minus 32: int8 [blocks, 16]
    (gguf's Q3_K.dequantize_blocks)."""
    n = len(packed)
    low = packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    high = packed[:, 8:].reshape(n, 1, 4) >> np.array(CRUMBS, dtype=np.uint8).reshape(1, 4, 1)
    six = (low.reshape(n, 16) & np.uint8(15)) | ((high.reshape(n, 16) & np.uint8(3)) << np.uint8(4))
    return six.astype(np.int8) - np.int8(32)


def _iq4_xs_scales(packed: np.ndarray) -> np.ndarray:
    """An IQ4_XS block's 8 sub-block scales from its 6 bytes after d (the high 2 bits of each in
    a little-endian uint16, the low 4 two to a byte), minus 32: int8 [blocks, 8] (gguf's
    IQ4_XS.dequantize_blocks)."""
    n = len(packed)
    high = packed[:, :2].copy().view(np.uint16)  # [n, 1]
    high = (high >> np.arange(0, 16, 2, dtype=np.uint16).reshape(1, 8)).astype(np.uint8)
    low = packed[:, 2:].reshape(n, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)
    six = (low.reshape(n, 8) & np.uint8(15)) | ((high & np.uint8(3)) << np.uint8(4))
    return six.astype(np.int8) - np.int8(32)


def _half(blocks: np.ndarray, at: tuple[int, int]) -> np.ndarray:
    """A float16 field of every block, as float32 [blocks, 1]."""
    return blocks[:, at[0] : at[0] + 2].copy().view(np.float16).astype(np.float32)
