"""The compiled CPU kernels of each build this CPU runs (the `ops` fixture) against the PyTorch
paths they replace (which are themselves tested against transformers): same results within the
dtype's rounding, and bad input is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from thermostat import kernels
from thermostat.models.attention import AttentionMetadata
from thermostat.models.kv_cache import PagedKVCache
from thermostat.models.kv_spec import KVCacheSpec
from thermostat.models.rope import apply_rotary

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_kernels_build_where_the_cpu_allows(ops):
    """On a CPU with the instruction sets, a failed build is a bug, not a silent fallback."""
    if kernels.unavailable_reason() is None:
        assert kernels.ops() is not None, kernels.status()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_add(ops, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 576, generator=g).to(dtype)
    r = torch.randn(7, 576, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    want = F.rms_norm(x.float(), (576,), w.float(), 1e-6)
    close(ops.rms_norm(x, w, 1e-6), want, dtype)

    residual = r.clone()
    got = ops.add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(residual, r + x)  # the add rounds exactly like torch's
    close(got, F.rms_norm((r + x).float(), (576,), w.float(), 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_a_strided_view(ops, dtype):
    g = torch.Generator().manual_seed(1)
    t, heads, d = 5, 4, 64
    qkv = torch.randn(t, heads * d + 32, generator=g).to(dtype)  # extra columns: a strided view
    x = qkv[:, : heads * d].view(t, heads, d)
    angles = torch.rand(t, d // 2, generator=g) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    want = apply_rotary(x.float(), cos.float(), sin.float())
    tail = qkv[:, heads * d :].clone()
    out = ops.rotary(x, cos, sin)
    assert out.data_ptr() == x.data_ptr()
    close(x, want, dtype)
    assert torch.equal(qkv[:, heads * d :], tail)  # nothing outside the view is touched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(ops, dtype):
    gate_up = (torch.randn(5, 2 * 64, generator=torch.Generator().manual_seed(4)) * 6).to(dtype)
    gate, up = gate_up.float().split(64, dim=-1)
    close(ops.silu_mul(gate_up), F.silu(gate) * up, dtype)
    huge = torch.tensor([[-1e4] * 16 + [1e4] * 16], dtype=dtype)  # exp under- and overflow
    close(ops.silu_mul(huge), torch.tensor([[-0.0] * 16]), dtype)


def filled_cache(
    kv_dtype, compute_dtype, num_blocks=12, block_size=4, hkv=2, d=64, seed=2, with_ops=None
):
    spec = KVCacheSpec.key_value(1, hkv, d, block_size, kv_dtype)
    cache = PagedKVCache(spec, num_blocks, compute_dtype, with_ops)
    g = torch.Generator().manual_seed(seed)
    n = num_blocks * block_size
    k = torch.randn(n, hkv, d, generator=g).to(compute_dtype)
    v = torch.randn(n, hkv, d, generator=g).to(compute_dtype)
    cache.write(0, (k, v), torch.arange(n))
    return cache


def decode_meta(tables: list[list[int]], lens: list[int], block_size: int, window=None):
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    ctx = torch.tensor(lens)
    pos = torch.arange(width * block_size)
    mask = pos[None, :] < ctx[:, None]
    if window:
        mask &= pos[None, :] > ctx[:, None] - 1 - window
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        num_decodes=len(lens),
        decode_block_tables=bt,
        decode_context_lens=ctx,
        decode_mask=mask[:, None, None, :],
        prefills=[],
        sliding_window=window,
    )


@pytest.mark.parametrize(
    "kv_dtype,compute_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float8_e4m3fn, torch.bfloat16),
        (torch.float8_e4m3fn, torch.float32),
    ],
)
@pytest.mark.parametrize("window", [None, 5])
def test_decode_attention_reads_blocks_in_place(ops, kv_dtype, compute_dtype, window):
    cache = filled_cache(kv_dtype, compute_dtype, with_ops=ops)
    # scattered, shared and partly filled blocks; GQA with 3 query heads per KV head
    tables = [[7, 2, 9], [0], [11, 3, 5, 1], [7, 2]]
    lens = [10, 1, 16, 6]
    meta = decode_meta(tables, lens, 4, window)
    # q as the model passes it: a strided view of the fused qkv output
    qkv = torch.randn(4, 8 * 64, generator=torch.Generator().manual_seed(3)).to(compute_dtype)
    q = qkv[:, : 6 * 64].view(4, 6, 64)
    want = _as_float(cache).decode_attention(q.float(), 0, meta, 0.125)
    got = ops.decode_attention(
        q, *cache.layer_storage(0), meta.decode_block_tables, meta.decode_context_lens, 0.125,
        window or 0,
    )  # fmt: skip
    close(got, want, compute_dtype)
    assert cache._decode == cache._decode_compiled  # the cache chose the kernel when built
    torch.testing.assert_close(cache.decode_attention(q, 0, meta, 0.125), got, atol=0, rtol=0)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("window", [None, 300])
def test_long_contexts_split_into_chunks_and_stay_batch_invariant(ops, kv_dtype, window):
    """Contexts over 256 tokens are attended in chunks whose partial softmaxes are merged: the
    result matches the reference at every length around a chunk edge, and each row alone is the
    same bits as in the batch."""
    cache = filled_cache(kv_dtype, torch.bfloat16, num_blocks=64, block_size=16, with_ops=ops)
    lens = [700, 1, 256, 257, 513, 1000]
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(4)).tolist()
    tables = [perm[: (n + 15) // 16] for n in lens]
    meta = decode_meta(tables, lens, 16, window)
    qkv = torch.randn(len(lens), 8 * 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    q = qkv[:, : 6 * 64].view(len(lens), 6, 64)
    want = _as_float(cache).decode_attention(q.float(), 0, meta, 0.125)
    storage = cache.layer_storage(0)
    got = ops.decode_attention(
        q, *storage, meta.decode_block_tables, meta.decode_context_lens, 0.125, window or 0
    )
    close(got, want, torch.bfloat16)
    for i in range(len(lens)):
        alone = ops.decode_attention(
            q[i : i + 1], *storage, meta.decode_block_tables[i : i + 1],
            meta.decode_context_lens[i : i + 1], 0.125, window or 0,
        )  # fmt: skip
        assert torch.equal(alone, got[i : i + 1]), lens[i]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("head_dim", [32, 48, 128, 256])
def test_every_head_dim_matches_the_reference(ops, kv_dtype, head_dim):
    """bf16 queries over heads of a multiple of 32 run in bf16 pair dot products, other multiples
    of 16 in floats: both match the reference, across a chunk edge and an odd chunk, and a row
    alone is the same bits as in the batch."""
    cache = filled_cache(
        kv_dtype, torch.bfloat16, num_blocks=40, block_size=16, hkv=2, d=head_dim, with_ops=ops
    )
    lens = [300, 1, 17, 513]
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(6)).tolist()
    tables = [perm[: (n + 15) // 16] for n in lens]
    meta = decode_meta(tables, lens, 16)
    q = torch.randn(len(lens), 8, head_dim, generator=torch.Generator().manual_seed(7)).bfloat16()
    want = _as_float(cache).decode_attention(q.float(), 0, meta, head_dim**-0.5)
    storage = cache.layer_storage(0)
    got = ops.decode_attention(
        q, *storage, meta.decode_block_tables, meta.decode_context_lens, head_dim**-0.5, 0
    )
    close(got, want, torch.bfloat16)
    alone = ops.decode_attention(
        q[3:], *storage, meta.decode_block_tables[3:], meta.decode_context_lens[3:],
        head_dim**-0.5, 0,
    )  # fmt: skip
    assert torch.equal(alone, got[3:])


def test_every_fp8_value_is_read_exactly(ops):
    """An fp8 cache's bytes reach the arithmetic unchanged, subnormals and signs included: one
    token of context with value scale 1 makes the output that token's value row, the bf16 of
    every e4m3 value but the NaNs (never stored)."""
    cache = filled_cache(
        torch.float8_e4m3fn, torch.bfloat16, num_blocks=2, block_size=4, hkv=1, d=256,
        with_ops=ops,
    )  # fmt: skip
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[[0x7F, 0xFF]] = 0
    _, value, _, value_scale = cache.layer_storage(0)
    value[1, 0, 0] = codes
    value_scale[1, 0, 0] = 1.0
    meta = decode_meta([[1]], [1], 4)
    q = torch.randn(1, 1, 256, generator=torch.Generator().manual_seed(8)).bfloat16()
    got = ops.decode_attention(
        q, *cache.layer_storage(0), meta.decode_block_tables, meta.decode_context_lens, 1 / 16, 0
    )
    assert torch.equal(got[0, 0], codes.view(torch.float8_e4m3fn).to(torch.bfloat16))


def _as_float(cache: PagedKVCache) -> PagedKVCache:
    """The same cache contents on the PyTorch paths, gathered in float32 (the reference path's
    dequantization)."""
    view = PagedKVCache(cache.spec, cache.num_blocks, torch.float32)
    view.store, view.scales = cache.store, cache.scales
    return view


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [False, True], ids=["cache-in-dtype", "cache-fp8"])
def test_write_kv_matches_index_copy(ops, dtype, fp8):
    """The kernel's cache write equals the PyTorch path's, from strided views of a qkv output:
    an fp8 cache's bytes and scales too (a head of zeros: the scale's floor; one of 1e4s and
    one of subnormal-sized values: e4m3's range at both ends)."""
    qkv = torch.randn(3, 6 * 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    qkv[0, 128:192] = 0.0
    qkv[1, 192:256] *= 1e4 if dtype != torch.float16 else 1e2
    qkv[2, 256:320] *= 1e-4
    k, v = qkv[:, 128:].view(3, 2, 2, 64).unbind(1)
    slots = torch.tensor([5, 0, 17])
    kv_dtype = torch.float8_e4m3fn if fp8 else dtype
    ours, ref = filled_cache(kv_dtype, dtype, with_ops=ops), filled_cache(kv_dtype, dtype)
    assert ours._write == ours._write_compiled and ref._write == ref._write_torch
    ours.write(0, (k, v), slots)
    ref.write(0, (k, v), slots)
    for name in ("key", "value"):
        assert torch.equal(ours.store[name][0], ref.store[name][0])
        assert torch.equal(ours.scales[name][0], ref.scales[name][0])
    key_cache, value_cache, key_scale, value_scale = ours.layer_storage(0)
    with pytest.raises(ValueError, match="slot out of range"):
        ops.write_kv(key_cache, value_cache, k, v, torch.tensor([5, 0, 99]), key_scale, value_scale)
    if fp8:
        with pytest.raises(ValueError, match="fp8 caches need float scales"):
            ops.write_kv(key_cache, value_cache, k, v, slots)  # no scales


def test_decode_attention_refuses_bad_tables(ops):
    cache = filled_cache(torch.float32, torch.float32)
    q = torch.randn(1, 6, 64)
    storage = cache.layer_storage(0)
    with pytest.raises(ValueError, match="block id"):
        ops.decode_attention(q, *storage, torch.tensor([[99]]), torch.tensor([3]), 1.0, 0)
    with pytest.raises(ValueError, match="context length"):
        ops.decode_attention(q, *storage, torch.tensor([[1]]), torch.tensor([5]), 1.0, 0)
    with pytest.raises(ValueError, match="head shapes"):
        ops.decode_attention(torch.randn(1, 5, 64), *storage, torch.tensor([[1]]),
                             torch.tensor([3]), 1.0, 0)  # fmt: skip
