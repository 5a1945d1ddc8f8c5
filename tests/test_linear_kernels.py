"""The compiled linear layers (bf16 VNNI packing, int8 / int4 blocks) of each kernel build this CPU
can run (the `ops` fixture: the full AVX-512 one, the AVX2 one, which runs on AVX-512 machines
too) against their PyTorch references: same results within the dtype's rounding, the same bits per
row at any batch size, bad input refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from thermostat import kernels
from thermostat.kernels.build import AVX2, FULL
from thermostat.models.grids import quantize_int4_min
from thermostat.models.quant import IQ4_LEVELS, QuantizedWeight, quantize, reference_linear

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}

INT_FORMATS = ["int8", "int4", "int4-min", "k4", "k8"]


def quantized(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    """`quantize(w, fmt)`; "int4-min": int4's minimum form (`bits` 5, a Q4_1 file's blocks);
    "k4" / "k8": the GGUF K-quants' forms with float32 scales (`bits` 6: d, m per 32; `bits` 9:
    int8 with a d per 16 and an m per 32), d a float16 times a 6-bit integer as a K-quant's (no
    float16 value, and q d exact in float32)."""
    k = w.shape[1]
    padded = F.pad(w.float(), (0, -k % 32))
    if fmt == "int4-min":
        q, d, z, m = quantize_int4_min(padded)
        return QuantizedWeight.pack(q[:, :k], d, z, m)
    if fmt == "k4":
        blocks = padded.view(w.shape[0], -1, 32)
        m = blocks.amin(dim=-1)
        d = ((blocks.amax(dim=-1) - m) / 15 / 37).half().float() * 37
        q = torch.round((blocks - m[..., None]) / d[..., None]).clamp(0, 15)
        return QuantizedWeight.pack(q.view(w.shape[0], -1)[:, :k].to(torch.uint8), d, m=m, bits=6)
    if fmt == "k8":
        blocks = padded.view(w.shape[0], -1, 32)
        m = blocks.mean(dim=-1)
        halves = (blocks - m[..., None]).reshape(w.shape[0], -1, 16)
        d = (halves.abs().amax(dim=-1) / 127 / 37).half().float() * 37
        q = torch.round(halves / d[..., None]).clamp(-128, 127)
        return QuantizedWeight.pack(q.view(w.shape[0], -1)[:, :k].to(torch.int8), d, m=m, bits=9)
    return quantize(w, fmt)


@pytest.mark.parametrize("rows", [1, 3, 17, 70, 130])
@pytest.mark.parametrize("k,n", [(576, 960), (33, 7), (1536, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_vnni(ops, rows, k, n, bias):
    """Any number of rows (AMX tiles where the CPU has them, else bf16 dot products or FMAs)."""
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = ops.linear_vnni(x, ops.pack_vnni(w), n, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


def batch_invariant(linear, x: torch.Tensor) -> None:
    """Each row of `linear(x)` is the same bits computed alone, in any prefix of the batch."""
    full = linear(x)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 31, 32, 33, 95, 96, 97):
        if rows <= len(x):
            assert torch.equal(linear(x[:rows]), full[:rows]), rows
    assert torch.equal(linear(x[5:6]), full[5:6])


def test_linear_vnni_is_batch_invariant(ops):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(200, 576, generator=g) * 0.05).bfloat16()
    packed, b = ops.pack_vnni(w), torch.randn(200, generator=g).bfloat16()
    batch_invariant(lambda x: ops.linear_vnni(x, packed, 200, b),
                    torch.randn(130, 576, generator=g).bfloat16())  # fmt: skip


@pytest.mark.parametrize("i,k", [(1536, 576), (48, 33), (208, 100)])  # I: 16 mod 64 and 32 mod 64
@pytest.mark.parametrize("bias", [False, True])
def test_linear_swiglu_is_linear_then_silu_mul_bit_for_bit(ops, i, k, bias):
    """The fused op (AMX: the product never written out) gives the two ops' bits, every row
    count: 32-row slabs, a last slab of 16 rows or fewer, a decode row."""
    g = torch.Generator().manual_seed(i + k)
    w = (torch.randn(2 * i, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(2 * i, generator=g).bfloat16() if bias else None
    packed = ops.pack_vnni(w)
    x = (torch.randn(130, k, generator=g) * 4).bfloat16()
    for rows in (1, 5, 16, 17, 32, 33, 48, 130):
        want = ops.silu_mul(ops.linear_vnni(x[:rows], packed, 2 * i, b))
        assert torch.equal(ops.linear_swiglu(x[:rows], packed, i, b), want), rows
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.linear_swiglu(x, packed, i - 8, b)
    with pytest.raises(ValueError, match="does not match"):
        ops.linear_swiglu(x, packed, i + 64, b)


def test_linear_vnni_refuses_bad_input(ops):
    w = ops.pack_vnni(torch.randn(8, 64).bfloat16())
    with pytest.raises(ValueError, match="M >= 1"):
        ops.linear_vnni(torch.randn(0, 64).bfloat16(), w, 8, None)
    with pytest.raises(ValueError, match="does not match"):
        ops.linear_vnni(torch.randn(1, 12).bfloat16(), w, 8, None)
    with pytest.raises(ValueError, match="x must be"):
        ops.linear_vnni(torch.randn(1, 64), w, 8, None)
    with pytest.raises(ValueError, match="pack_vnni"):
        ops.linear_vnni(torch.randn(1, 64).bfloat16(), torch.randn(8, 64).bfloat16(), 8, None)


@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize(
    "dtype,rows,k,n",
    [
        (torch.bfloat16, 1, 576, 960),
        (torch.float32, 3, 100, 30),
        (torch.float16, 6, 33, 7),
        (torch.bfloat16, 37, 1536, 130),
    ],
)
def test_linear_quant_matches_its_reference(ops, fmt, dtype, rows, k, n):
    """The kernel computes quant.reference_linear's arithmetic (within the fused
    multiply-adds' last bits and the output dtype's rounding) for every row count."""
    g = torch.Generator().manual_seed(rows + k + n)
    w = torch.randn(n, k, generator=g) * 0.05
    qw = quantized(w, fmt)
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g)
    want = reference_linear(x.float(), qw, b)
    got = ops.linear_quant(x, qw, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want, atol=2 * TOL[dtype], rtol=TOL[dtype])
    # and the float product, within the format's error (int4: a random weight's 16 levels)
    exact = F.linear(x.float(), w, b)
    error = ((got.float() - exact).norm() / exact.norm()).item()
    assert error < (0.015 if fmt == "int8" else 0.1), error


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_linear_quant_is_batch_invariant(ops, fmt):
    g = torch.Generator().manual_seed(4)
    qw = quantized(torch.randn(200, 576, generator=g) * 0.05, fmt)
    b = torch.randn(200, generator=g)
    batch_invariant(lambda x: ops.linear_quant(x, qw, b),
                    torch.randn(130, 576, generator=g).bfloat16())  # fmt: skip


def test_linear_quant_takes_any_zero_point_at_batch_size(ops):
    """int4 blocks whose zero point z puts q - z outside int8 (z below -112: the AMX path's signed
    bytes cannot hold them, so their group takes the other path) beside ordinary ones: the same
    bits per row at any batch size, and the reference's values."""
    g = torch.Generator().manual_seed(8)
    n, k = 192, 96
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=g) * 0.01).half()
    z = torch.randint(-10, 20, (n, k // 32), generator=g, dtype=torch.int8)
    z[70, 1] = -128  # the second group's
    z[5, 0], z[140, 2] = -112, 127  # the first and third groups': the ends that fit
    qw = QuantizedWeight.pack(q, d, z)
    x = torch.randn(40, k, generator=g).bfloat16()
    batch_invariant(lambda rows: ops.linear_quant(rows, qw, None), x)
    want = reference_linear(x.float(), qw)
    torch.testing.assert_close(ops.linear_quant(x, qw, None).float(), want, atol=4e-2, rtol=2e-2)


def test_linear_quant_refuses_bad_input(ops):
    qw = quantize(torch.randn(8, 64), "int8")
    with pytest.raises(ValueError, match="does not match"):
        ops.linear_quant(torch.randn(1, 12), qw, None)
    with pytest.raises(ValueError, match="bias"):
        ops.linear_quant(torch.randn(1, 64), qw, torch.randn(3))
    q4 = quantize(torch.randn(8, 64), "int4")
    with pytest.raises(ValueError, match="packed int8"):
        ops.linear_quant(torch.randn(1, 64), replace(q4, bits=8), None)
    with pytest.raises(ValueError, match="packed int5"):
        ops.linear_quant(torch.randn(1, 64), replace(q4, bits=5), None)
    with pytest.raises(ValueError, match="packed int6"):
        ops.linear_quant(torch.randn(1, 64), replace(q4, bits=6), None)
    with pytest.raises(ValueError, match="packed int10"):
        ops.linear_quant(torch.randn(1, 64), replace(q4, bits=10), None)
    with pytest.raises(ValueError, match="bits must be 8, 4, 5, 6, 9, 10, 11 or 12"):
        ops.linear_quant(torch.randn(1, 64), replace(q4, bits=7), None)


@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(7, 33), (130, 100), (300, 576)])
def test_quant_rows_are_the_reference_rows(ops, fmt, dtype, n, k):
    """The embedding lookup of a quantized table gives QuantizedWeight.rows' values exactly."""
    qw = quantized(torch.randn(n, k, generator=torch.Generator().manual_seed(n)), fmt)
    ids = torch.tensor([0, n - 1, n // 2, 0, 3 % n])
    got = ops.quant_rows(qw, ids, dtype)
    assert got.dtype == dtype and torch.equal(got, qw.rows(ids, dtype))
    assert torch.equal(ops.quant_rows(qw, torch.arange(n), dtype), qw.rows(torch.arange(n), dtype))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(1, 1), (65, 33), (130, 70), (300, 576)])
def test_one_pass_quantization_makes_the_tensor_codes_records(ops, fmt, dtype, n, k):
    """A float weight (on no grid) quantized at load in one pass by the kernels (`quantize_int8`,
    `quantize_int4`) gets the records of the tensor code and QuantizedWeight.pack, byte for byte:
    N and K padded, an all-zero block, a block far from 0 (int4's symmetric fallback), values
    far below the block's largest (rounding to 0), every input dtype."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1
    w[0, : min(32, k)] = 0
    if n > 3 and k >= 32:
        w[3, :32] += 5.0
    if k > 40:
        w[1, 32:40] = 1e-6
    w = w.to(dtype)
    tensor_code = quantize(w, fmt)
    one_pass = quantize(w, fmt, ops)
    assert one_pass.bits == tensor_code.bits == (8 if fmt == "int8" else 4)
    assert torch.equal(one_pass.packed, tensor_code.packed)
    assert (one_pass.out_features, one_pass.in_features) == (n, k)


@pytest.mark.parametrize("bits", [8, 4, 5, 6, 9])
@pytest.mark.parametrize("n,k", [(1, 1), (65, 33), (130, 70), (300, 576)])
def test_records_packed_in_one_pass_are_the_tensor_codes(ops, bits, n, k):
    """QuantizedWeight.pack with the kernels (`pack_records`, a GGUF file's blocks, a dequantized
    checkpoint's grid) gives the tensor code's bytes for every format code: N and K padded,
    float32 minimums (rounded to float16 for code 5 as the tensor code rounds them), every q and
    scale, -0.0 and code 9's two d's per block included."""
    g = torch.Generator().manual_seed(n * 7 + k + bits)
    kb = (k + 31) // 32
    if bits in (8, 9):
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    else:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = torch.rand(n, 2 * kb if bits == 9 else kb, generator=g) * 0.01
    d = d if bits in (6, 9) else d.half()
    z = torch.randint(-128, 128, (n, kb), generator=g, dtype=torch.int8) if bits in (4, 5) else None
    m = torch.randn(n, kb, generator=g) * 0.1 if bits in (5, 6, 9) else None
    if m is not None and bits == 9:
        m[:, ::2] = -0.0  # Q6_K's: no minimum
    code = None if bits in (8, 4, 5) else bits
    tensor_code = QuantizedWeight.pack(q, d, z, m, bits=code)
    one_pass = QuantizedWeight.pack(q, d, z, m, bits=code, ops=ops)
    given = torch.empty_like(tensor_code.packed)  # into records given (a fused weight's part)
    assert QuantizedWeight.pack(q, d, z, m, bits=code, ops=ops, out=given).packed is given
    assert torch.equal(given, tensor_code.packed)
    with pytest.raises(ValueError, match="out must be"):
        QuantizedWeight.pack(q, d, z, m, bits=code, ops=ops, out=given[..., :-1])
    assert one_pass.bits == tensor_code.bits == bits
    assert torch.equal(one_pass.packed, tensor_code.packed)


def super_blocks(
    n: int, k: int, bits: int, seed: int, levels: bool = False
) -> tuple[torch.Tensor, ...]:
    """A K-quant's values in `bits` 6's or 9's form (q; d per 32, or per 16 for 9; m per 32) and
    their super-blocks' (d, dmin) [n, k / 256, 2]: d = d_super sc, m = -(dmin mn), sc 6-bit (9:
    any int8, as Q6_K's), mn 6-bit, some of each super-block's d and dmin 0 (-0.0 scales).
    `levels`: IQ4_XS's (9's form): q IQ4's levels, m -0.0."""
    g = torch.Generator().manual_seed(seed)
    kb, per = k // 32, 2 if bits == 9 else 1
    supers = (torch.rand(n, k // 256, 2, generator=g) * 0.01).half().float()
    supers[0, 0] = 0.0  # a super-block all zeros: its scales +0.0 or -0.0 as the file's
    low, high = (-128, 128) if bits == 9 else (0, 64)
    sc = torch.randint(low, high, (n, kb * per), generator=g).float()
    mn = torch.randint(0, 64, (n, kb), generator=g).float()
    d = supers[..., 0].repeat_interleave(8 * per, dim=1) * sc
    m = -(supers[..., 1].repeat_interleave(8, dim=1) * mn)
    if levels:
        q = torch.tensor(IQ4_LEVELS, dtype=torch.int8)[torch.randint(0, 16, (n, k), generator=g)]
        supers[..., 1], m = 0.0, torch.full_like(m, -0.0)
    elif bits == 9:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    else:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    return q, d, m, supers


@pytest.mark.parametrize("bits", [10, 11, 12])
@pytest.mark.parametrize("n,k", [(64, 256), (130, 768)])
def test_super_block_records_hold_the_same_weight_in_less_memory(ops, bits, n, k):
    """`bits` 10, 11 and 12 (a K-quant's super-blocks: d and dmin once per 256, int8 scales per
    block; 12: IQ4_XS's, its levels as 4-bit indices) hold 6's and 9's values exactly:
    `classic` gives their records back, the kernels' products and rows are the same bits at any
    row count and in every dtype, in 23% / 19% / 59% fewer bytes. Scales that are not the
    super-block's times an integer, super-block scales that are not float16 values, a K that is
    not whole super-blocks and (12) a q that is not one of IQ4's levels are refused."""
    classic_bits = 6 if bits == 10 else 9
    q, d, m, supers = super_blocks(n, k, classic_bits, seed=n + bits, levels=bits == 12)
    classic = QuantizedWeight.pack(q, d, m=m, bits=classic_bits)
    m = None if bits == 12 else m  # (its m: -0.0, adds nothing)
    compact = QuantizedWeight.pack(q, d, m=m, bits=bits, ops=ops, supers=supers)
    less = {10: 0.78, 11: 0.81, 12: 0.42}[bits]
    assert compact.packed.nbytes < classic.packed.nbytes * less
    padding = slice(None, n)  # (padded rows' m: -0.0 in one, 0.0 in the other)
    back = compact.classic()
    assert back.bits == classic_bits
    if n % 64 == 0:
        assert torch.equal(back.packed, classic.packed)
    values = compact.dequantize()[padding].view(torch.int32)
    assert torch.equal(values, classic.dequantize().view(torch.int32))
    g = torch.Generator().manual_seed(k)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(17, k, generator=g).to(dtype)
        for rows in (1, 2, 3, 17):
            got = ops.linear_quant(x[:rows], compact, None)
            assert torch.equal(got, ops.linear_quant(x[:rows], classic, None))
        ids = torch.tensor([0, n - 1, n // 2])
        assert torch.equal(ops.quant_rows(compact, ids, dtype), ops.quant_rows(classic, ids, dtype))
        assert torch.equal(compact.rows(ids, dtype), classic.rows(ids, dtype))
    off = d.clone()
    off[1, 3] = off[1, 3] * 1.5 + 1e-3
    with pytest.raises(ValueError, match="not its super-block's"):
        QuantizedWeight.pack(q, off, m=m, bits=bits, ops=ops, supers=supers)
    with pytest.raises(ValueError, match="float16 values"):
        QuantizedWeight.pack(q, d, m=m, bits=bits, ops=ops, supers=supers + 1e-6)
    with pytest.raises(ValueError, match="multiple of 256"):
        per = d.shape[1] // (k // 32)  # d per block
        short = q[:, :-32], d[:, :-per], None, None if m is None else m[:, :-1]
        QuantizedWeight.pack(*short, bits=bits, ops=ops, supers=supers)
    with pytest.raises(ValueError, match="needs the kernels"):
        QuantizedWeight.pack(q, d, m=m, bits=bits, supers=supers)
    if bits == 12:
        odd = q.clone()
        odd[2, 5] = 0  # no level
        with pytest.raises(ValueError, match="not one of IQ4's levels"):
            QuantizedWeight.pack(odd, d, bits=bits, ops=ops, supers=supers)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_weight_on_a_grid_is_searched_not_requantized(ops, fmt):
    """A weight dequantized from an integer grid is not quantized in one pass: its grid is found
    (`grid_steps`) and it comes back exactly."""
    g = torch.Generator().manual_seed(3)
    on_grid = quantize(torch.randn(64, 96, generator=g), fmt).dequantize()
    assert torch.equal(quantize(on_grid, fmt, ops).dequantize(), on_grid)
    assert torch.equal(quantize(on_grid, fmt, ops).packed, quantize(on_grid, fmt).packed)


def test_quant_rows_refuses_bad_ids(ops):
    qw = quantize(torch.randn(8, 64), "int8")
    with pytest.raises(ValueError, match="id out of range"):
        ops.quant_rows(qw, torch.tensor([8]), torch.bfloat16)
    with pytest.raises(ValueError, match="id out of range"):
        ops.quant_rows(qw, torch.tensor([-1]), torch.bfloat16)
    with pytest.raises(ValueError, match="int64"):
        ops.quant_rows(qw, torch.tensor([1], dtype=torch.int32), torch.bfloat16)


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_both_builds_give_int_weights_the_same_bits(fmt):
    """The integer sums are exact and the float step per block is the same fused multiply-add on
    either build, so an AVX2 server and an AVX-512 one agree bit for bit (AVX-512 machines run
    both)."""
    full, avx2 = kernels.build_ops(FULL), kernels.build_ops(AVX2)
    if full is None or avx2 is None:
        pytest.skip(f"needs both builds ({kernels.status()})")
    g = torch.Generator().manual_seed(9)
    qw = quantized(torch.randn(200, 1000, generator=g) * 0.05, fmt)
    b = torch.randn(200, generator=g)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(9, 1000, generator=g).to(dtype)
        assert torch.equal(full.linear_quant(x, qw, b), avx2.linear_quant(x, qw, b)), dtype
