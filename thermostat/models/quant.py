"""Integer weight formats: int8 and 4-bit in blocks of 32 along K, per output row.

| format | per block of 32 weights of one output              | bytes / weight | like           |
|--------|----------------------------------------------------|----------------|----------------|
| int8   | q in [-128, 127], d float16: w = d q               | 34 / 32 = 1.06 | llama.cpp q8_0 |
| int4   | q in [0, 15], d float16, z int8: w = d (q - z)     | 19 / 32 = 0.59 | GPTQ / AWQ     |
|        | ... and m float16: w = d (q - z) + m (`bits` 5)    | 21 / 32 = 0.66 | llama.cpp q4_1 |
|        | q in [0, 15], d, m float32: w = d q + m (`bits` 6) | 24 / 32 = 0.75 | q4_K           |
| int8   | q int8, a float32 d per 16 and m float32 per 32:   | 44 / 32 = 1.38 | q5_1, q5_K,    |
|        | w = d q + m (`bits` 9)                             |                | q6_K           |
| int4   | `bits` 6's values in a K-quant's super-blocks      | 37 / 64 = 0.58 | q4_K           |
|        | (`bits` 10)                                        |                |                |
| int8   | `bits` 9's values in super-blocks (`bits` 11)      | 71 / 64 = 1.11 | q5_K, q6_K,    |
|        |                                                    |                | q3_K           |
| int8   | IQ4's levels as 4-bit indices, `bits` 9's values   | 73 / 128       | iq4_xs         |
|        | in super-blocks (`bits` 12)                        | = 0.57         |                |

`bits` 6 and 9 hold a GGUF K-quant's blocks as the file has them (gguf_blocks.py): a K-quant's
block scale, its float16 super-block scale times a 6-bit (Q6_K: 8-bit) one, needs more bits than
float16 has, and float32 holds it exactly, as it does the minimum (dmin times a 6-bit m); Q6_K's
sub-blocks of 16 take `bits` 9's two scales per block (its m, -0.0, adds nothing: w = d q to the
bit, sign of zero included). Nothing here quantizes a float weight to them.

`bits` 10 and 11 hold the same values as 6 and 9 in the file's own factored form, a record per
8 blocks (a K-quant's super-block of 256 along K): the super-block's float16 d and dmin, and per
block an int8 scale (two for 11) and minimum, d = d_super sc and m = -(dmin mn), products the
kernels form exactly (so the same bits as 6 and 9), in a quarter less memory for 6's values and a
fifth less for 9's; `bits` 12 holds IQ4_XS's levels as their 4-bit indices, which the kernels
look up (vpshufb) as they run, in 0.57 bytes a weight where 9 took 1.38. The kernels pack them
(`pack_records`, from 6's or 9's d and m and the super-blocks' scales); `classic` turns them
back into 6 or 9 in tensor code.

int4 takes its minimum form for a weight whose blocks lie on it (`on_minimum_grid`): a block
of a Q4_1 file (w = d q + m, m no multiple of d) comes back exactly, m its least value and d its
range / 15, as llama.cpp's quantizer wrote them. Other weights keep the integer zero point.

int4's integer zero point holds symmetric 4-bit (q4_0: z = 8), GPTQ and AWQ groups (a group of
128 is four blocks with the same d and z) exactly. Quantizing a weight that already lies on such a
grid (dequantized from one of those checkpoints) finds the grid and gives its integers back
(`grid_step`); a float weight gets d = max|w| / 127 (int8), or its range in 15 steps (int4).
q = -128 appears only where a checkpoint's grid has it (compressed-tensors' symmetric int8 rounds
-127.5 steps to -128); the kernel stores q + 128 as an unsigned byte, so it costs nothing.

Everything here is tensor math (with the kernels, `grid_step` runs compiled): `quantize_*` turn
a float weight into (q, d[, z]), `QuantizedWeight.pack` lays them out for the kernel
(thermostat.kernels `linear_quant`, whose comment gives the layout), `dequantize` and
`reference_linear` are the float reference the kernel is tested against: activations quantized
per row and block as q8_0 does (s = max|x| / 127, xq = x / s rounded to nearest even), integer
dot products per block, then the block's scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from thermostat.models.grids import (
    BLOCK,
    PROBE,
    grid_step,
    on_minimum_grid,
    quantize_int4,
    quantize_int4_min,
    quantize_int8,
)

if TYPE_CHECKING:
    from thermostat.kernels import LinearOps

Bits = Literal[8, 4, 5, 6, 9, 10, 11, 12]  # the table above; the kernels' layout codes (common.h)
FORMATS: dict[str, Bits] = {"int8": 8, "int4": 4}
NIBBLES = (4, 5, 6, 10)  # the formats of 4-bit q (the others' q are int8)
FLOAT32_SCALES = (6, 9, 10, 11, 12)  # d and m given in float32
# the super-block formats -> the format of their values
SUPER: dict[Bits, Bits] = {10: 6, 11: 9, 12: 9}
SUPER_BLOCKS = 8  # K blocks a super-block format's record holds
LEVELS: Bits = 12  # IQ4_XS's: int8 q, each one of IQ4_LEVELS, stored as its 4-bit index
# IQ4's 16 levels (ggml's kvalues_iq4nl), named by a 4-bit index
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


# bytes of a record's scales: d (64 float16, or float32 for 6 and 9; two per output for 9),
# z (64 int8: 4 and 5) and m (64 float16: 5; float32: 6 and 9)
HEADER = {8: 128, 4: 192, 5: 320, 6: 512, 9: 768}
BODY = {8: 2048, 4: 1024, 5: 1024, 6: 1024, 9: 2048}  # bytes of one K block of 64 outputs' weights
MINIMUM_AT = {5: 192, 6: 256, 9: 512}  # where m starts in the header
# a super-block format's record of 8 K blocks: d, dmin (64 float16 each; 12: d only), sc int8
# [8][(2)][64], mn int8 [8][64] (not 12), then the 8 blocks' bodies (12: 4-bit level indices)
SUPER_HEADER = {10: 1280, 11: 1792, 12: 1152}
SUPER_BODY = {10: 1024, 11: 2048, 12: 1024}


def block_bytes(bits: Bits) -> int:
    """Bytes of a format's records per K block of 64 outputs (a super-block format's record / 8)."""
    if bits in SUPER:
        return (SUPER_HEADER[bits] + SUPER_BLOCKS * SUPER_BODY[bits]) // SUPER_BLOCKS
    return HEADER[bits] + BODY[bits]


@dataclass
class QuantizedWeight:
    """One linear layer's weight [out_features, in_features] in int8 or int4, packed for the
    kernel: one record per group of 64 outputs and block of 32 along K (N padded to a multiple of
    64 with zero rows, K to a multiple of 32 with zeros); `linear_quant`'s comment gives the
    record's layout."""

    bits: Bits
    out_features: int
    in_features: int
    packed: torch.Tensor  # uint8 [N / 64, K / 32, block_bytes]

    @classmethod
    def pack(
        cls,
        q: torch.Tensor,
        d: torch.Tensor,
        z: torch.Tensor | None = None,
        m: torch.Tensor | None = None,
        bits: Bits | None = None,
        ops: LinearOps | None = None,
        out: torch.Tensor | None = None,
        supers: torch.Tensor | None = None,
    ) -> QuantizedWeight:
        """q [N, K] (int8 in [-128, 127] with z None; uint8 in [0, 15] with z), d [N, ceil(K /
        32)] float16, z the same shape int8, m (with z) float16 -> the kernel's layout. `bits` 6
        (q uint8 in [0, 15]) or 9 (q int8, d [N, 2 ceil(K / 32)]: a scale per 16) with d and m
        float32 and no z; 10 and 11 the same as 6 and 9 and `supers` [N, K / 256, 2] float32,
        each super-block's d and dmin (only the kernels pack these). `ops`: the kernels, which
        pack them in one pass (`pack_records`: the same bytes), into `out` where it is given (a
        fused weight's records of this part)."""
        if bits is None:
            bits = 8 if z is None else (4 if m is None else 5)
        n, k = q.shape
        kb = (k + BLOCK - 1) // BLOCK
        scales = 2 * kb if bits in (9, 11, 12) else kb
        if d.shape != (n, scales) or (z is not None and z.shape != (n, kb)):
            raise ValueError(f"scales must be [{n}, {scales}] for a [{n}, {k}] weight")
        if bits in FLOAT32_SCALES and (
            z is not None
            or (m is None) != (bits == LEVELS)
            or (m is not None and m.shape != (n, kb))
        ):
            raise ValueError(f"bits {bits} takes float32 d and m [{n}, {kb}] (12: no m), no z")
        scale_dtype = torch.float32 if bits in FLOAT32_SCALES else torch.float16
        if (
            ops is not None
            and d.dtype == scale_dtype
            and q.dtype == (torch.uint8 if bits in NIBBLES else torch.int8)
            and (z is None or z.dtype == torch.int8)
        ):
            minimum = None if m is None else m.to(scale_dtype).contiguous()
            zeros = None if z is None else z.contiguous()
            given = None if supers is None else supers.float().contiguous()
            q, d = q.contiguous(), d.contiguous()
            records = ops.pack_records(q, d, zeros, minimum, bits, out, given)
            return cls(bits, n, k, records)
        if out is not None or bits in SUPER:
            raise ValueError("packing into given records or super-blocks needs the kernels")
        groups = (n + 63) // 64
        full = torch.zeros(groups * 64, kb * BLOCK, dtype=torch.uint8)
        if bits not in NIBBLES:
            full[:n, :k] = (q.to(torch.int16) + 128).to(torch.uint8)
            full[n:] = 128  # padded rows: q = 0
            full[:, k:] = 128
            # [g, c, n, kb, kq, j] -> [g, kb, kq, c, n, j]
            body = full.view(groups, 4, 16, kb, 8, 4).permute(0, 3, 4, 1, 2, 5)
        else:
            full[:n, :k] = q
            nibbles = full.view(groups, 4, 16, kb, 2, 4, 4)  # [g, c, n, kb, half, kq, j]
            joined = nibbles[:, :, :, :, 0] | (nibbles[:, :, :, :, 1] << 4)
            body = joined.permute(0, 3, 4, 1, 2, 5)
        if bits in FLOAT32_SCALES:
            halves = [d[:, 0::2], d[:, 1::2]] if bits == 9 else [d]
            parts = [_group_major(h.float(), groups).view(torch.uint8) for h in halves]
        else:
            parts = [_group_major(d, groups).view(torch.uint8)]
        if z is not None:
            parts.append(_group_major(z, groups).view(torch.uint8))
        if m is not None:
            minimum = m.float() if bits in FLOAT32_SCALES else m.half()
            parts.append(_group_major(minimum, groups).view(torch.uint8))
        parts.append(body.reshape(groups, kb, -1))
        return cls(bits, n, k, torch.cat(parts, dim=-1).contiguous())

    def classic(self) -> QuantizedWeight:
        """A super-block format's weight in the format of its values (10 -> 6, 11 and 12 -> 9):
        the same values, exactly (the products d_super sc and -(dmin mn) are exact in float32;
        12's indices become their levels, its m -0.0); any other weight as it is."""
        if self.bits not in SUPER:
            return self
        groups, kb, _ = self.packed.shape
        classic, header = SUPER[self.bits], SUPER_HEADER[self.bits]
        halves, sc_at = 2 if classic == 9 else 1, 128 if self.bits == LEVELS else 256
        records = self.packed.view(groups, kb // SUPER_BLOCKS, -1)
        d_super = records[..., :128].contiguous().view(torch.float16).float()  # [G, S, 64]
        sc = records[..., sc_at : sc_at + 512 * halves].contiguous().view(torch.int8).float()
        d = d_super[:, :, None, None] * sc.view(groups, -1, SUPER_BLOCKS, halves, 64)
        if self.bits == LEVELS:
            m = torch.full((groups, kb, 64), -0.0)
            indices = records[..., header:].reshape(groups, kb, -1).long()  # [kq][c][n][4]
            levels = (torch.tensor(IQ4_LEVELS) + 128).to(torch.uint8)
            body = torch.cat([levels[indices & 15], levels[indices >> 4]], dim=-1)  # K 0-15, 16-31
        else:
            dmin = records[..., 128:256].contiguous().view(torch.float16).float()
            mn = records[..., 256 + 512 * halves : header].contiguous().view(torch.int8).float()
            m = -(dmin[:, :, None] * mn.view(groups, -1, SUPER_BLOCKS, 64))
            body = records[..., header:].reshape(groups, kb, BODY[classic])
        parts = [
            d.reshape(groups, kb, halves * 64).contiguous().view(torch.uint8),
            m.reshape(groups, kb, 64).contiguous().view(torch.uint8),
            body,
        ]
        return QuantizedWeight(classic, self.out_features, self.in_features, torch.cat(parts, -1))

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The inverse of `pack`: (q, d, z) with q [N, K / 32 * 32] (K's padding kept); d [N,
        K / 32] (bits 9: [N, K / 16], a scale per 16 along K)."""
        if self.bits in SUPER:
            return self.classic().unpack()
        groups, kb, _ = self.packed.shape
        n, header = self.out_features, HEADER[self.bits]
        body = self.packed[..., header:]
        if self.bits not in NIBBLES:
            q = body.reshape(groups, kb, 8, 4, 16, 4).permute(0, 3, 4, 1, 2, 5)
            q = (q.reshape(groups * 64, -1).to(torch.int16) - 128).to(torch.int8)
        else:
            b = body.reshape(groups, kb, 4, 4, 16, 4)  # [g, kb, kq, c, n, j]
            both = torch.stack([b & 15, b >> 4], dim=2)  # [g, kb, half, kq, c, n, j]
            q = both.permute(0, 4, 5, 1, 2, 3, 6).reshape(groups * 64, -1)
        scales, zeros = self._header()
        z = None if zeros is None else _row_major(zeros, n)
        return q[:n], _row_major(scales, n), z

    def _header(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(d [G, KB, 64] (bits 9: [G, 2 KB, 64], K's halves in order), z [G, KB, 64] int8 or
        None), outputs in [c][n] order."""
        if self.bits in FLOAT32_SCALES:
            halves = 2 if self.bits == 9 else 1
            d = self.packed[..., : 256 * halves].contiguous().view(torch.float32)
            groups, kb = d.shape[:2]
            return d.view(groups, kb, halves, 64).reshape(groups, kb * halves, 64), None
        d = self.packed[..., :128].contiguous().view(torch.float16)
        z = None if self.bits == 8 else self.packed[..., 128:192].contiguous().view(torch.int8)
        return d, z

    def minimums(self) -> torch.Tensor | None:
        """m [N, K / 32] of the minimum forms (bits 5: float16; 6 and 9: float32), else None."""
        if self.bits in SUPER:
            return self.classic().minimums()
        if self.bits not in MINIMUM_AT:
            return None
        at = MINIMUM_AT[self.bits]
        dtype = torch.float32 if self.bits in FLOAT32_SCALES else torch.float16
        size = 256 if self.bits in FLOAT32_SCALES else 128
        m = self.packed[..., at : at + size].contiguous().view(dtype)
        return _row_major(m, self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] as the kernel's arithmetic sees it: ((q - z) d) + m in float32, one
        rounding where there is an m (the K-quants' and Q4_1 / Q5_1's own)."""
        q, d, z = self.unpack()
        blocks = q.float().view(q.shape[0], d.shape[1], -1)  # [N, scales, 32 or 16]
        if z is not None:
            blocks = blocks - z.float()[..., None]
        blocks = blocks * d.float()[..., None]
        m = self.minimums()
        if m is not None:
            per_scale = d.shape[1] // m.shape[1]
            blocks = blocks + m.float().repeat_interleave(per_scale, dim=1)[..., None]
        return blocks.reshape(q.shape[0], -1)[:, : self.in_features].to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` (any shape) of the weight, dequantized: [*ids.shape, K] in `dtype` (an
        embedding lookup): fma(q - z, d, m) per weight, as the kernels' quant_rows. Gathers only
        the rows' own bytes: their scales and the weights of each of their K blocks."""
        if self.bits in SUPER:
            return self.classic().rows(ids, dtype)
        groups, kb, record = self.packed.shape
        header, quads = HEADER[self.bits], 4 if self.bits in NIBBLES else 8
        flat = ids.reshape(-1)
        lane = flat % 64  # the output's place in its group's [c][n] order
        c, n = lane // 16, lane % 16
        # [T, KB]: where each of the rows' records starts
        base = (flat // 64 * kb)[:, None] * record + torch.arange(kb)[None, :] * record
        data = self.packed.view(-1)
        f32 = self.bits in FLOAT32_SCALES
        width, scale_dtype = (4, torch.float32) if f32 else (2, torch.float16)

        def scale(at: int) -> torch.Tensor:  # [T, KB, 1] float32: the rows' scale at byte `at`
            where = (base + at + width * lane[:, None])[..., None] + torch.arange(width)
            return data[where].view(scale_dtype)[..., 0].float()[..., None]

        # the rows' weight bytes of a record: [kq][c][n][4], K = 4 kq + j (int4: + 16, high)
        within = (torch.arange(quads) * 256)[:, None] + torch.arange(4)
        at = base[..., None] + (header + c * 64 + n * 4)[:, None, None] + within.reshape(-1)
        b = data[at]  # [T, KB, 4 quads]
        if self.bits in NIBBLES:
            q = torch.cat([b & 15, b >> 4], dim=2).float()
        else:
            q = (b.to(torch.int16) - 128).float()
        if self.bits in (4, 5):
            q = q - data[base + 128 + lane[:, None]].view(torch.int8).float()[..., None]
        d = scale(0)
        if self.bits == 9:  # K 0-15 and 16-31 each with their own d
            d = torch.cat([d.expand(-1, -1, 16), scale(256).expand(-1, -1, 16)], dim=2)
        w = q * d
        if self.bits in MINIMUM_AT:
            w = w + scale(MINIMUM_AT[self.bits])
        out = w.reshape(len(flat), -1)[:, : self.in_features].to(dtype)
        return out.reshape(*ids.shape, self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes held (the padding included)."""
        return self.packed.nbytes


def _group_major(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[N, KB] -> [groups, KB, 64] (rows padded with zeros)."""
    full = torch.zeros(groups * 64, t.shape[1], dtype=t.dtype)
    full[: t.shape[0]] = t
    return full.view(groups, 64, -1).permute(0, 2, 1).contiguous()


def _row_major(t: torch.Tensor, n: int) -> torch.Tensor:
    """[groups, KB, 64] -> [N, KB]."""
    return t.permute(0, 2, 1).reshape(-1, t.shape[1])[:n]


def quantize(weight: torch.Tensor, fmt: str, ops: LinearOps | None = None) -> QuantizedWeight:
    """A float weight [N, K] in `fmt` ('int8' or 'int4'); K is padded with zeros to whole blocks.
    `ops`: the kernels, which find the grids faster (`grid_step`) and quantize a float32, bf16 or
    float16 weight on no grid in one pass (`quantize_int8`, `quantize_int4`: the same records)."""
    n, k = weight.shape
    if ops is not None and weight.dtype in ONE_PASS_DTYPES and not _searched(weight, fmt, ops):
        one_pass = ops.quantize_int8 if FORMATS[fmt] == 8 else ops.quantize_int4
        return QuantizedWeight(FORMATS[fmt], n, k, one_pass(weight.contiguous()))
    parts = [_quantize_rows(weight[r : r + ROWS], fmt, ops) for r in range(0, n, ROWS)]
    q, d = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    if FORMATS[fmt] == 8:
        return QuantizedWeight.pack(q[:, :k], d, ops=ops)
    if any(len(p) == 4 for p in parts):  # some rows in the minimum form: all of them in it
        parts = [_quantize_rows(weight[r : r + ROWS], fmt, ops, True) for r in range(0, n, ROWS)]
        q, d = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        z, m = torch.cat([p[2] for p in parts]), torch.cat([p[3] for p in parts])
        return QuantizedWeight.pack(q[:, :k], d, z, m, ops=ops)
    return QuantizedWeight.pack(q[:, :k], d, torch.cat([p[2] for p in parts]), ops=ops)


ONE_PASS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the kernels' quantize_int*
ROWS = 4096  # rows quantized at a time: float32 temporaries of a few MB, not of the whole weight


def _searched(weight: torch.Tensor, fmt: str, ops: LinearOps) -> bool:
    """Whether quantizing `weight` searches its blocks' grids or takes int4's minimum form: where
    the first blocks of some ROWS rows lie on a grid (their PROBE blocks: `grid_steps`) or on the
    minimum form (int4: `on_minimum_grid`). Where neither, the kernels' `quantize_int8` /
    `quantize_int4` make the same records in one pass."""
    per_row = (weight.shape[1] + BLOCK - 1) // BLOCK
    lead = max((PROBE + per_row - 1) // per_row, PROBE // 2)  # rows both probes read
    for r in range(0, weight.shape[0], ROWS):
        rows = weight[r : r + min(lead, ROWS)]
        padded = torch.zeros(rows.shape[0], per_row * BLOCK)
        padded[:, : rows.shape[1]] = rows.float()
        int4 = FORMATS[fmt] != 8
        if (grid_step(padded.view(-1, BLOCK)[:PROBE], int4, ops) > 0).any():
            return True
        if int4 and on_minimum_grid(padded[:, : BLOCK * 2][: PROBE // 2]):
            return True
    return False


def _quantize_rows(
    rows: torch.Tensor, fmt: str, ops: LinearOps | None, minimums: bool = False
) -> tuple[torch.Tensor, ...]:
    """(q, d) (int8), (q, d, z) (int4) or (q, d, z, m) (int4's minimum form: where its first
    blocks lie on that form's grid, or with `minimums`) of some rows of a weight, K padded with
    zeros to whole blocks."""
    n, k = rows.shape
    padded = torch.zeros(n, (k + BLOCK - 1) // BLOCK * BLOCK, dtype=torch.float32)
    padded[:, :k] = rows.float()
    if FORMATS[fmt] == 8:
        return quantize_int8(padded, ops)
    if minimums or on_minimum_grid(padded[:, : BLOCK * 2][: PROBE // 2]):
        return quantize_int4_min(padded)
    return quantize_int4(padded, ops)


def quantize_activations(x: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, blocks, 32] float holding integers in [-127, 127], s [M, blocks])
    as the kernel computes them (K padded with zeros)."""
    padded = torch.zeros(x.shape[0], blocks * BLOCK, dtype=torch.float32)
    padded[:, : x.shape[1]] = x.float()
    v = padded.view(x.shape[0], blocks, BLOCK)
    s = v.abs().amax(dim=-1) / 127
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    return torch.round(v * inv[..., None]), s


def reference_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch (float32; the kernel's fused multiply-adds round
    differently in the last bits): [M, K] -> [M, N] in x's dtype."""
    q, d, z = weight.unpack()
    kb = (q.shape[1] + BLOCK - 1) // BLOCK
    per = d.shape[1] // kb  # scales per block: 2 for bits 9
    xq, s = quantize_activations(x, kb)
    wq = q.float().view(q.shape[0], kb * per, BLOCK // per)
    xs = xq.view(x.shape[0], kb * per, BLOCK // per)
    acc = torch.einsum("mbk,nbk->mnb", xs, wq)  # integers below 2^24: exact
    if z is not None:
        acc = acc - z.float()[None] * xq.sum(dim=-1)[:, None, :]  # still exact integers
    terms = acc * (d.float()[None] * s.repeat_interleave(per, dim=1)[:, None, :])
    m = weight.minimums()
    if m is not None:  # + m s sum(xq) per block
        terms = terms.view(*terms.shape[:2], kb, per).sum(dim=-1)
        terms = terms + m.float()[None] * (s * xq.sum(dim=-1))[:, None, :]
    y = terms.sum(dim=-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
