"""Integer grids: the one a checkpoint's weights already lie on (`grid_step`), found again so
that they come back exactly, and float weights put on one (int8; int4 with an integer zero
point, or in its minimum form, w = d q + m). quant.py packs what these return."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from thermostat.kernels import LinearOps

BLOCK = 32  # weights per scale, along K


def grid_step(blocks: torch.Tensor, affine: bool, ops: LinearOps | None = None) -> torch.Tensor:
    """The step of an integer grid through 0 that each block [B, 32] of float32 values already
    lies on, 0 where none fits the format: every value step * j for integers j in [-128, 127]
    (int8) or with max j - min j <= 15 (int4). A weight dequantized from q8_0, q4_0, GPTQ, AWQ
    or compressed-tensors lies on its checkpoint's grid; a float weight almost never does.

    The step is the smallest gap or nonzero |value|, or that divided by 2, 3 or 4 (a block of a
    per-channel int8 grid may hold no two neighbouring integers: its smallest gap is then 2, 3
    or 4 steps); the divisors are tried only on blocks whose first values fit them. With `ops`,
    the kernels' `grid_steps` (the same float operations per block; this sorts every block of
    the model: ~60% of a SmolLM2's load in int8 without them)."""
    if ops is not None:
        return ops.grid_steps(blocks.contiguous(), affine)
    ordered = blocks.sort(dim=-1).values
    gaps = ordered.diff(dim=-1)
    candidates = torch.cat(  # the step divides every gap and every value
        [
            torch.where(gaps > 0, gaps, torch.inf),
            torch.where(ordered != 0, ordered.abs(), torch.inf),
        ],
        dim=-1,
    )
    smallest = candidates.amin(dim=-1)
    finite = torch.isfinite(smallest)
    smallest = torch.where(finite, smallest, torch.ones_like(smallest))
    step = torch.where(finite & _on_grid(blocks, smallest, affine), smallest, 0.0)
    for divisor in (2, 3, 4):
        sub = smallest / divisor
        lead = blocks[:, :4] / sub[:, None]
        maybe = (step == 0) & finite & ((lead - lead.round()).abs().amax(dim=-1) <= 1e-3)
        rows = maybe.nonzero().squeeze(1)
        if len(rows):
            fits = _on_grid(blocks[rows], sub[rows], affine)
            step[rows[fits]] = sub[rows[fits]]
    return step


def _on_grid(blocks: torch.Tensor, step: torch.Tensor, affine: bool) -> torch.Tensor:
    """Whether every value of each block [B, 32] is step * j for integers j the format holds."""
    ratio = blocks / step[:, None]
    j = ratio.round()
    on_grid = (ratio - j).abs().amax(dim=-1) <= 1e-3
    lo, hi = j.amin(dim=-1), j.amax(dim=-1)
    if affine:
        return on_grid & (hi - lo <= 15) & (lo.abs() <= 127)
    return on_grid & (lo >= -128) & (hi <= 127)


PROBE = 64  # blocks of a weight looked at first: on no grid, the weight's others are not searched


def grid_steps(blocks: torch.Tensor, affine: bool, ops: LinearOps | None) -> torch.Tensor:
    """`grid_step` of a weight's blocks [N, KB, 32] -> [N, KB], all 0 without a search when its
    first PROBE blocks lie on no grid (a float checkpoint's weights: the search is 40% of their
    quantization time; a dequantized checkpoint's lie on their grid everywhere)."""
    flat = blocks.reshape(-1, BLOCK)
    if not (grid_step(flat[:PROBE], affine, ops) > 0).any():
        return torch.zeros(blocks.shape[:2])
    return grid_step(flat, affine, ops).view(blocks.shape[:2])


def quantize_int8(
    weight: torch.Tensor, ops: LinearOps | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (K % 32 == 0) -> (q [N, K] int8 in [-128, 127], d [N, K / 32] float16):
    d = max|w| / 127 of each block (q8_0), or the block's own grid step where it has one
    (`grid_step`: only there can q be -128); rounded to float16 first, then q = round(w / d)."""
    blocks = weight.float().reshape(weight.shape[0], -1, BLOCK)
    step = grid_steps(blocks, False, ops)
    d = torch.where(step > 0, step, blocks.abs().amax(dim=-1) / 127).half()
    inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = torch.round(blocks * inv[..., None]).clamp(-128, 127)
    return q.reshape(weight.shape).to(torch.int8), d


def quantize_int4_min(
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] (K % 32 == 0) -> (q [N, K] uint8 in [0, 15], d, z (0), m [N, K / 32]):
    m = the block's least value and d = its range / 15, both float16, q = round((w - m) / d).
    A Q4_1 block (its q spanning 0..15, as llama.cpp's quantizer writes them) comes back with
    the file's own d, m and q."""
    blocks = weight.float().reshape(weight.shape[0], -1, BLOCK)
    lo, hi = blocks.amin(dim=-1), blocks.amax(dim=-1)
    m = lo.half()
    d = ((hi - m.float()) / 15).half()
    inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = torch.round((blocks - m.float()[..., None]) * inv[..., None]).clamp(0, 15)
    z = torch.zeros_like(d, dtype=torch.int8)
    return q.reshape(weight.shape).to(torch.uint8), d, z, m


def quantize_int4(
    weight: torch.Tensor, ops: LinearOps | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] (K % 32 == 0) -> (q [N, K] uint8 in [0, 15], d [N, K / 32] float16,
    z [N, K / 32] int8): the block's own grid where it has one (`grid_step`), else its range
    [min, max] in 15 steps with z = round(-min / d) (a block far from 0, which no int8 zero
    point reaches, takes the symmetric d = max|w| / 7, z = 8)."""
    blocks = weight.float().reshape(weight.shape[0], -1, BLOCK)
    lo, hi = blocks.amin(dim=-1), blocks.amax(dim=-1)
    step = grid_steps(blocks, True, ops)
    on_grid = step > 0
    span = torch.where(on_grid, step, (hi - lo) / 15).half().float()
    safe = torch.where(span > 0, span, torch.ones_like(span))
    z = torch.where(on_grid, -(lo / safe).round(), (-lo / safe).round())
    far = (z < -128) | (z > 127)
    symmetric = (torch.maximum(lo.abs(), hi.abs()) / 7).half().float()
    span = torch.where(far, symmetric, span)
    z = torch.where(far, torch.full_like(z, 8), z)
    inv = torch.where(span > 0, 1 / span, torch.zeros_like(span))
    q = (torch.round(blocks * inv[..., None]) + z[..., None]).clamp(0, 15)
    return q.reshape(weight.shape).to(torch.uint8), span.half(), z.to(torch.int8)


def on_minimum_grid(weight: torch.Tensor) -> bool:
    """Whether some block of `weight` [N, K] lies on int4's minimum form exactly (a Q4_1
    file's: every value m + d j, j in 0..15) and not on an integer zero point's grid."""
    q, d, _, m = quantize_int4_min(weight)
    blocks = weight.float().reshape(weight.shape[0], -1, BLOCK)
    back = q.float().reshape(blocks.shape) * d.float()[..., None] + m.float()[..., None]
    exact = ((back - blocks).abs() <= 1e-3 * d.float()[..., None]).all(dim=-1) & (d > 0)
    if not bool(exact.any()):
        return False
    return not bool((grid_step(blocks[exact], True) > 0).all())
