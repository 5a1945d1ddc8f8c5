"""Paged attention over the KV cache, with its per-step metadata passed explicitly.

Token order in a step's flat batch (T tokens):

| rows                     | what                                                  |
|--------------------------|-------------------------------------------------------|
| [0, num_decodes)         | one new token per decoding sequence, batched          |
| [num_decodes, T)         | prefill chunks, one segment per sequence, in order    |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from thermostat.models.kv_cache import PagedKVCache


@dataclass
class PrefillSegment:
    """A chunk of q_len new tokens of one sequence whose context is ctx_len tokens long
    (the chunk included); `mask` is [q_len, ctx_len] (True = attend) or None for plain causal
    attention over a fresh sequence."""

    q_len: int
    ctx_len: int
    block_table: torch.Tensor  # [1, nb] int64, covering ctx_len tokens
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, nb] int64, padded with block 0
    decode_context_lens: torch.Tensor  # [num_decodes] int64, the new token included
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, nb * block_size] bool, False past context
    prefills: list[PrefillSegment]
    sliding_window: int | None = None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens. Writes k/v into the cache, then
    attends each token to its sequence's context. Returns [T, Hq, D]. Decodes run in the cache's
    decode attention (the compiled kernel reads the blocks in place where the cache allows it);
    prefill chunks use SDPA."""
    cache.write(layer, (k, v), meta.slot_mapping)
    nd = meta.num_decodes
    if not meta.prefills:
        return cache.decode_attention(q[:nd], layer, meta, scale)  # a pure decode batch
    out = torch.empty_like(q)
    if nd:
        out[:nd] = cache.decode_attention(q[:nd], layer, meta, scale)
    start, segs, i = nd, meta.prefills, 0
    while i < len(segs):
        seg = segs[i]
        if seg.mask is None and not cache.spec.quantized:
            # fresh sequences: the context is the chunk itself; a run of them with equal length
            # is one batched causal SDPA (one call per layer instead of one per sequence)
            j = i + 1
            while j < len(segs) and segs[j].mask is None and segs[j].q_len == seg.q_len:
                j += 1
            n, length = j - i, seg.q_len
            end = start + n * length
            qs, ks, vs = (torch.unflatten(t[start:end], 0, (n, length)) for t in (q, k, v))
            o = F.scaled_dot_product_attention(
                qs.transpose(1, 2),  # [n, Hq, q_len, D]
                ks.transpose(1, 2),
                vs.transpose(1, 2),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            out[start:end] = o.transpose(1, 2).flatten(0, 1)
            start, i = end, j
            continue
        end = start + seg.q_len
        ck, cv = cache.gather(layer, seg.block_table)
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),  # [Hq, q_len, D]
            ck[0, : seg.ctx_len].transpose(0, 1),
            cv[0, : seg.ctx_len].transpose(0, 1),
            attn_mask=seg.mask,
            is_causal=seg.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = o.transpose(0, 1)
        start, i = end, i + 1
    return out
