"""The compiled prefill attention (kernels/prefill_attention.h): a chunk of new tokens attends
causally to its sequence's bf16 or fp8 blocks read in place. Held to a float64 reference, to the
same bits whatever chunks a prompt arrives in (an fp8 cache: the bits of a bf16 cache holding its
rows dequantized), and, in the engine, to the same prompt logprobs and greedy tokens whole,
chunked and after a prefix-cache hit."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import kernel_build, prompt_logprobs, write_model
from thermostat import LLM, SamplingParams, kernels
from thermostat.models.attention import AttentionMetadata, PrefillSegment, paged_attention
from thermostat.models.kv_cache import PagedKVCache
from thermostat.models.kv_spec import KVCacheSpec


@pytest.fixture(scope="module", params=["avx512", "avx512-emulated", "avx512-no-amx"])
def ops(request) -> kernels.CpuOps:
    """The AVX-512 build, the one with prefill attention, with its bf16 dot products as the CPU
    runs them and emulated."""
    built = kernel_build(request.param)
    assert built.has_prefill_attention
    return built


def random_cache(blocks: int, block_size: int, hkv: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (blocks, block_size, hkv, d)
    return (torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16())


NO_SCALES = torch.empty(0)


def attend(ops, q, key_cache, value_cache, table, start, scale) -> torch.Tensor:
    """The kernel on bf16 caches (no scales)."""
    return ops.prefill_attention(q, key_cache, value_cache, NO_SCALES, NO_SCALES, table, start,
                                 scale)  # fmt: skip


def reference(q, key_cache, value_cache, table, start, scale) -> torch.Tensor:
    """Causal attention in float64 over the context gathered through the table."""
    t, hq, _ = q.shape
    bs, hkv = key_cache.shape[1], key_cache.shape[2]
    length = start + t
    pos = torch.arange(length)
    slots = table[pos // bs] * bs + pos % bs
    k, v = (c.flatten(0, 1)[slots].double().repeat_interleave(hq // hkv, 1) for c in
            (key_cache, value_cache))  # fmt: skip
    scores = torch.einsum("thd,lhd->htl", q.double(), k) * scale
    future = pos[None, :] > torch.arange(start, length)[:, None]
    weights = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("htl,lhd->thd", weights, v)


SHAPES = [  # Hq, Hkv, D, context length, rows already cached, block size
    (9, 3, 64, 100, 0, 16),  # SmolLM2's heads
    (9, 3, 64, 300, 137, 16),
    (8, 2, 128, 70, 5, 4),
    (4, 4, 64, 33, 0, 16),  # no grouping: 48 rows an item
    (16, 1, 32, 200, 199, 8),  # one new row after a long context
    (14, 2, 64, 129, 64, 32),  # a group of 7: lanes left over in each item
]


@pytest.mark.parametrize("hq,hkv,d,length,start,bs", SHAPES)
def test_matches_reference_and_chunks_change_no_bit(ops, hq, hkv, d, length, start, bs):
    nb = (length + bs - 1) // bs
    key_cache, value_cache = random_cache(nb + 5, bs, hkv, d, seed=length)
    table = torch.randperm(nb + 5, generator=torch.Generator().manual_seed(1))[:nb]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(length - start, hq, d, generator=g).bfloat16()
    scale = d**-0.5
    whole = attend(ops, q, key_cache, value_cache, table, start, scale)
    want = reference(q, key_cache, value_cache, table, start, scale)
    assert (whole.double() - want).abs().max() < 0.02  # bf16 inputs, weights and output
    pieces, row = [], start
    for size in (7, 40, 1, 1000):  # the same rows in uneven chunks
        end = min(length, row + size)
        if end > row:
            q_rows = q[row - start : end - start]
            pieces.append(attend(ops, q_rows, key_cache, value_cache, table, row, scale))
        row = end
    assert torch.equal(torch.cat(pieces), whole)


def test_strided_queries_and_extreme_scores(ops):
    """q as a view into a wider projection output, and scores far past exp's range."""
    key_cache, value_cache = random_cache(4, 16, 2, 64, seed=3)
    key_cache *= 30
    table = torch.tensor([2, 0, 3])
    qkv = torch.randn(40, 6 * 64).bfloat16() * 30
    q = qkv[:, : 4 * 64].view(40, 4, 64)
    got = attend(ops, q, key_cache, value_cache, table, 0, 0.125)
    assert torch.isfinite(got).all()
    want = reference(q, key_cache, value_cache, table, 0, 0.125)
    assert (got.double() - want).abs().max() < 0.1  # one-hot weights: a value's bf16 rounding
    assert torch.equal(got, attend(ops, q.contiguous(), key_cache, value_cache, table, 0, 0.125))


def test_bad_input_is_refused(ops):
    key_cache, value_cache = random_cache(4, 16, 2, 64, seed=4)
    q = torch.randn(20, 4, 64).bfloat16()
    table = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="outside the block table"):
        attend(ops, q, key_cache, value_cache, table, 20, 1.0)
    with pytest.raises(ValueError, match="block id"):
        attend(ops, q, key_cache, value_cache, torch.tensor([1, 9]), 0, 1.0)
    with pytest.raises(ValueError, match="bfloat16"):
        attend(ops, q.float(), key_cache, value_cache, table, 0, 1.0)
    with pytest.raises(ValueError, match="multiple of 32"):
        short = random_cache(4, 16, 2, 16, seed=5)
        attend(ops, q[..., :16], *short, table, 0, 1.0)


def test_bad_input_is_refused_for_fp8(ops):
    key_cache, value_cache = (c.view(torch.uint8) for c in fp8_cache(4, 16, 2, 64, seed=4)[:2])
    q = torch.randn(20, 4, 64).bfloat16()
    with pytest.raises(ValueError, match="float scales"):
        ops.prefill_attention(q, key_cache, value_cache, NO_SCALES, NO_SCALES, torch.tensor([1, 2]),
                              0, 1.0)  # fmt: skip


def fp8_cache(blocks: int, block_size: int, hkv: int, d: int, seed: int):
    """fp8_e4m3 caches as PagedKVCache stores them (each row over its own scale, amax / 448),
    their scales, and the bf16 rows the SDPA path's gather makes of them."""
    g = torch.Generator().manual_seed(seed)
    caches, scales, dequantized = [], [], []
    for _ in range(2):
        x = torch.randn(blocks, block_size, hkv, d, generator=g) * 4
        x[0, 0] = 0.0  # an all-zero row: its scale is clamped, its values stay 0
        s = (x.abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-12)
        q8 = (x / s).to(torch.float8_e4m3fn)
        caches.append(q8)
        scales.append(s)
        dequantized.append((q8.float() * s).bfloat16())
    return caches[0], caches[1], scales[0], scales[1], dequantized[0], dequantized[1]


@pytest.mark.parametrize("hq,hkv,d,length,start,bs", SHAPES)
def test_fp8_cache_gives_the_bits_of_its_dequantized_rows(ops, hq, hkv, d, length, start, bs):
    nb = (length + bs - 1) // bs
    k8, v8, ks, vs, k16, v16 = fp8_cache(nb + 5, bs, hkv, d, seed=length)
    table = torch.randperm(nb + 5, generator=torch.Generator().manual_seed(1))[:nb]
    q = torch.randn(length - start, hq, d, generator=torch.Generator().manual_seed(2)).bfloat16()
    bytes_ = (k8.view(torch.uint8), v8.view(torch.uint8))
    got = ops.prefill_attention(q, *bytes_, ks, vs, table, start, d**-0.5)
    assert torch.equal(got, attend(ops, q, k16, v16, table, start, d**-0.5))
    half = (length - start + 1) // 2  # two chunks (one, for a single row)
    pieces = [ops.prefill_attention(q[:half], *bytes_, ks, vs, table, start, d**-0.5)]
    if half < length - start:
        pieces.append(
            ops.prefill_attention(q[half:], *bytes_, ks, vs, table, start + half, d**-0.5)
        )
    assert torch.equal(torch.cat(pieces), got)


def test_the_cache_chooses_it_for_bf16_and_fp8_blocks(ops):
    def cache(kv_dtype, compute_dtype, d=64):
        spec = KVCacheSpec.key_value(1, 2, d, 16, kv_dtype)
        return PagedKVCache(spec, 8, compute_dtype, ops)

    assert cache(torch.bfloat16, torch.bfloat16).attends_prefills(q_heads=6)
    assert not cache(torch.bfloat16, torch.bfloat16).attends_prefills(q_heads=98)  # group 49
    assert not cache(torch.bfloat16, torch.bfloat16, d=16).attends_prefills(q_heads=6)
    assert not cache(torch.float32, torch.float32).attends_prefills(q_heads=6)
    assert cache(torch.float8_e4m3fn, torch.bfloat16).attends_prefills(q_heads=6)
    assert not cache(torch.float8_e4m3fn, torch.float32).attends_prefills(q_heads=6)


def test_paged_attention_takes_it_and_agrees_with_sdpa(ops):
    """The same chunks through the compiled path and the SDPA path of a cache without it."""
    spec = KVCacheSpec.key_value(1, 2, 64, 16, torch.bfloat16)
    compiled, plain = (PagedKVCache(spec, 8, torch.bfloat16, o) for o in (ops, None))
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(50, h, 64, generator=g).bfloat16() for h in (6, 2, 2))
    table = torch.tensor([[5, 1, 7, 2]])
    slots = table[0, torch.arange(50) // 16] * 16 + torch.arange(50) % 16
    for c in (compiled, plain):
        c.write(0, (k[:30], v[:30]), slots[:30])  # a cached prefix of 30 tokens
    meta = _chunk_meta(slots[30:], table, start=30, length=50)
    got = paged_attention(q[30:], k[30:], v[30:], 0, compiled, meta, 0.125)
    want = paged_attention(q[30:], k[30:], v[30:], 0, plain, meta, 0.125)
    torch.testing.assert_close(got, want, atol=0.02, rtol=0.02)


def _chunk_meta(slots, table, start, length):
    q_pos = torch.arange(start, length)[:, None]
    mask = torch.arange(length)[None, :] <= q_pos
    return AttentionMetadata(
        slot_mapping=slots,
        num_decodes=0,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int64),
        decode_context_lens=torch.zeros(0, dtype=torch.int64),
        decode_mask=torch.zeros(0, 1, 1, 16, dtype=torch.bool),
        prefills=[PrefillSegment(length - start, length, table, mask)],
    )


# The engine: a bf16 model whose heads the kernel takes (head_dim 32, groups of 2).
PROMPTS = [list(range(3, 120)), [7, 8, 9] * 30 + [11], [300, 5, 17, 42, 99, 3]]


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    return write_model(
        tmp_path_factory.mktemp("prefill-attention"), "llama", dtype=torch.bfloat16,
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_engine_prompts_same_bits_whole_chunked_and_cached(bf16_model, kv):
    kernel_build("avx512")  # the engine's build (skipped where it cannot run)
    whole = LLM(str(bf16_model), enable_prefix_caching=False, kv_cache_dtype=kv)
    assert whole.engine.cache.attends_prefills(q_heads=4)  # the path under test runs
    vocab = 320
    want = prompt_logprobs(whole, PROMPTS, vocab)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = [o.token_ids for o in whole.generate(PROMPTS, greedy)]

    chunked = LLM(str(bf16_model), enable_prefix_caching=False, max_num_batched_tokens=13,
                  kv_cache_dtype=kv)  # fmt: skip
    cached = LLM(str(bf16_model), enable_prefix_caching=True, kv_cache_dtype=kv)
    cached.generate([p[:64] for p in PROMPTS], greedy)  # the prefixes, block-aligned, cached
    for llm in (chunked, cached):
        for got, expected in zip(prompt_logprobs(llm, PROMPTS, vocab), want, strict=True):
            assert torch.equal(got, expected)
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == tokens
