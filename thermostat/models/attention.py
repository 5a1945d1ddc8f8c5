"""Paged attention over the KV cache, with its per-step metadata passed explicitly.

Token order in a step's flat batch (T tokens):

| rows                     | what                                                  |
|--------------------------|-------------------------------------------------------|
| [0, num_decodes)         | decode rows, batched: one per decoding sequence, or   |
|                          | one per token a speculating sequence checks, each     |
|                          | attending up to its own position (its context length) |
| [num_decodes, T)         | prefill chunks, one segment per sequence, in order    |
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

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
    # The cache's window pools (pools 1.., thermostat.engine.kv_blocks), each one tensor per pool:
    # the new tokens' slots [T], and every sequence's table [num sequences, nb] (decodes first,
    # then prefill segments, as above; PLACEHOLDER (-1) where blocks were released).
    window_slot_mappings: tuple[torch.Tensor, ...] = ()
    window_block_tables: tuple[torch.Tensor, ...] = ()


def windowed(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """`meta` for a layer whose queries attend only to the last `window` positions (their own
    included) while the model's other layers see the whole context (Gemma 3's local layers): the
    decode rows' window for the kernel and their mask, each prefill segment's mask."""
    ctx_pos = torch.arange(meta.decode_mask.shape[-1])
    lens = meta.decode_context_lens
    recent = (ctx_pos[None, :] > lens[:, None] - 1 - window)[:, None, None, :]
    prefills = []
    for seg in meta.prefills:
        start = seg.ctx_len - seg.q_len
        q_pos = torch.arange(start, seg.ctx_len)[:, None]
        kv_pos = torch.arange(seg.ctx_len)[None, :]
        mask = (kv_pos <= q_pos) & (kv_pos > q_pos - window)
        plain = start == 0 and window >= seg.q_len  # causal alone already keeps the window
        prefills.append(replace(seg, mask=seg.mask if plain else mask))
    return replace(
        meta, sliding_window=window, decode_mask=meta.decode_mask & recent, prefills=prefills
    )


@dataclass(frozen=True)
class PrefillRun:
    """Rows [start, end) of the flat batch, attended in one SDPA call: either `count` fresh
    sequences of `length` tokens each (plain causal attention over the chunk itself, batched),
    or one segment that attends to context read back from the cache (`segment`)."""

    start: int
    end: int
    count: int
    length: int
    segment: PrefillSegment | None  # None: a batched run of fresh sequences

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, enable_gqa: bool
    ) -> torch.Tensor:
        """The run's SDPA call: q [end - start, Hq, D] over k, v [L, Hkv, D] (the run's own rows
        for fresh sequences, else the segment's context of ctx_len) -> [end - start, Hq, Dv]."""
        if self.segment is None:
            shape = (self.count, self.length)
            qs, ks, vs = (torch.unflatten(t, 0, shape).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(  # [n, Hq, q_len, Dv]
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=enable_gqa
            )
            return o.transpose(1, 2).flatten(0, 1)
        # 4-d like the batched call: SDPA then takes the same (flash) kernel, whose rows are the
        # same bits as a fresh sequence's; 3-d inputs take the math path, which rounds otherwise
        # (a prefix-cache hit or a later prefill chunk would change a prompt's logprobs).
        mask = self.segment.mask
        o = F.scaled_dot_product_attention(  # [1, Hq, q_len, Dv]
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return o[0].transpose(0, 1)


def prefill_runs(
    segments: list[PrefillSegment], start: int, quantized: bool
) -> Iterator[PrefillRun]:
    """The prefill segments (their rows from `start` on) as SDPA calls: a run of fresh
    sequences of one length is one batched causal call (one call per layer instead of one per
    sequence); any other segment, and every segment of a quantized cache (whose context is read
    back from the cache, as decodes read it), is a call of its own."""
    i = 0
    while i < len(segments):
        seg = segments[i]
        if seg.mask is None and not quantized:
            j = i + 1
            while j < len(segments) and segments[j].mask is None and segments[j].q_len == seg.q_len:
                j += 1
            end = start + (j - i) * seg.q_len
            yield PrefillRun(start, end, j - i, seg.q_len, None)
        else:
            j, end = i + 1, start + seg.q_len
            yield PrefillRun(start, end, 1, seg.q_len, seg)
        start, i = end, j


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
    prefill chunks in the cache's prefill attention where it has one (bf16 blocks read in place,
    whole context, no window), else in SDPA."""
    cache.write(layer, (k, v), meta.slot_mapping)
    nd = meta.num_decodes
    if not meta.prefills:
        return cache.decode_attention(q[:nd], layer, meta, scale)  # a pure decode batch
    in_place = meta.sliding_window is None and cache.attends_prefills(q.shape[1])
    if in_place and not nd and len(meta.prefills) == 1:  # one chunk, all the rows
        return cache.prefill_attention(q, layer, meta.prefills[0], scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = cache.decode_attention(q[:nd], layer, meta, scale)
    if in_place:
        start = nd
        for segment in meta.prefills:
            end = start + segment.q_len
            out[start:end] = cache.prefill_attention(q[start:end], layer, segment, scale)
            start = end
        return out
    for run in prefill_runs(meta.prefills, nd, cache.spec.quantized):
        start, end, seg = run.start, run.end, run.segment
        if seg is None:  # fresh sequences: the context is the chunk itself
            ks, vs = k[start:end], v[start:end]
        else:
            ck, cv = cache.gather(layer, seg.block_table)
            ks, vs = ck[0, : seg.ctx_len], cv[0, : seg.ctx_len]
        out[start:end] = run.attend(q[start:end], ks, vs, scale, enable_gqa=True)
    return out
