"""Where a DeepSeek-V4 step's tokens read and write the paged cache: per sequence, the slots of
its sliding window, the rows of its compressed entries and which queries see them, and the
windows its new tokens complete (each becomes one entry). Computed once per step from the
attention metadata and shared by every layer of a kind (thermostat.models.v4_attention).

For a sequence whose new tokens are positions [s, s + n) and a compression rate r:

| what               | positions                                    | visible to query t          |
|--------------------|----------------------------------------------|-----------------------------|
| window K=V rows    | [max(0, s - W + 1), s + n)                   | t - W < p <= t              |
| entries            | w in [0, (s + n) // r): row at w*r + r - 1   | w < (t + 1) // r            |
| windows completed  | w in [s // r, (s + n) // r)                  | (written this step)         |
| their state rows   | [w*r, w*r + r); with overlap [w*r - r, ...)  | (w = 0's overlap: none)     |

So a step reads window rows back to s - (W - 1), CSA state back to (s // r) * r - r >= s - (2r - 1)
and HCA state back to (s // r) * r >= s - (r - 1): the windows of those components
(thermostat.models.v4_cache), whose rows live in window pools. A component's slots come from its
pool's table (`V4Step.pools`; the new tokens' from the pool's slot mapping).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from thermostat.models.attention import AttentionMetadata
from thermostat.models.kv_spec import KVCacheSpec


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's new tokens this step: positions [start, start + length), rows
    [offset, offset + length) of the flat batch."""

    start: int
    length: int
    offset: int
    tables: tuple[torch.Tensor, ...]  # per pool: [nb] int64 block ids (the main pool's first)

    @property
    def end(self) -> int:
        return self.start + self.length

    def query_positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.end)


@dataclass(frozen=True)
class Keys:
    """What a group of B sequences of n queries each attends to (padded rows are not visible)."""

    window_slots: torch.Tensor  # [B, K] the window rows' slots, oldest first
    window_visible: torch.Tensor  # [B, n, K] bool
    entry_rows: torch.Tensor  # [B, E] rows of the rate's entry components
    entry_visible: torch.Tensor  # [B, n, E] bool: the window closed at or before the query


@dataclass(frozen=True)
class Emissions:
    """The windows completed this step, across the batch."""

    slots: torch.Tensor  # [N, width] slots of the state rows they mix
    valid: torch.Tensor  # [N, width] bool; False: before position 0 (weight 0)
    first: torch.Tensor  # [N] the window's first position (its rope position)
    rows: torch.Tensor  # [N] where its entry goes


@dataclass
class V4Step:
    seqs: list[SeqChunk]
    slot_mappings: tuple[torch.Tensor, ...]  # per pool: [T] the new tokens' slots
    block_size: int
    window: int
    pools: dict[str, int]  # component -> its pool (KVCacheSpec.pool_of)
    _memo: dict[tuple[object, ...], object] = field(default_factory=dict)

    @classmethod
    def of(cls, meta: AttentionMetadata, spec: KVCacheSpec, window: int) -> V4Step:
        def tables(main: torch.Tensor, i: int) -> tuple[torch.Tensor, ...]:
            return (main, *(t[i] for t in meta.window_block_tables))

        seqs = [
            SeqChunk(
                int(meta.decode_context_lens[i]) - 1, 1, i, tables(meta.decode_block_tables[i], i)
            )
            for i in range(meta.num_decodes)
        ]
        offset = meta.num_decodes
        for i, seg in enumerate(meta.prefills, start=meta.num_decodes):
            start = seg.ctx_len - seg.q_len
            seqs.append(SeqChunk(start, seg.q_len, offset, tables(seg.block_table[0], i)))
            offset += seg.q_len
        slot_mappings = (meta.slot_mapping, *meta.window_slot_mappings)
        pools = {c.name: spec.pool_of(c.name) for c in spec.components}
        return cls(seqs, slot_mappings, spec.block_size, window, pools)

    def new_slots(self, name: str) -> torch.Tensor:
        """[T] the slots of this step's tokens in component `name`'s pool."""
        return self.slot_mappings[self.pools[name]]

    def slots(self, seq: SeqChunk, positions: torch.Tensor, pool: int = 0) -> torch.Tensor:
        """The slots of a sequence's `positions` in a pool (any shape)."""
        bs, table = self.block_size, seq.tables[pool]
        return table[positions // bs] * bs + positions % bs

    def groups(self) -> list[tuple[slice, list[int]]]:
        """Sequences attended together, as (their rows of the flat batch, their indices): the
        decodes (one query each) as one group, then each prefill chunk alone."""
        decodes = [i for i, seq in enumerate(self.seqs) if seq.length == 1 and seq.offset == i]
        groups = [(slice(0, len(decodes)), decodes)] if decodes else []
        for i in range(len(decodes), len(self.seqs)):
            seq = self.seqs[i]
            groups.append((slice(seq.offset, seq.offset + seq.length), [i]))
        return groups

    def keys(self, members: list[int], rate: int) -> Keys:
        """The window rows and (rate > 0) the entries of `rate` that a group attends to."""
        key = ("keys", members[0], len(members), rate)
        if key not in self._memo:
            self._memo[key] = self._keys(members, rate)
        found = self._memo[key]
        assert isinstance(found, Keys)
        return found

    def _keys(self, members: list[int], rate: int) -> Keys:
        slots, seen, rows, visible = [], [], [], []
        for i in members:
            seq = self.seqs[i]
            q_pos = seq.query_positions()[:, None]
            kv_pos = torch.arange(max(0, seq.start - self.window + 1), seq.end)
            slots.append(self.slots(seq, kv_pos, self.pools["kv_nope"]))
            seen.append((kv_pos[None, :] <= q_pos) & (kv_pos[None, :] > q_pos - self.window))
            w = torch.arange(seq.end // rate if rate else 0)
            rows.append(self.slots(seq, w * rate + rate - 1) // max(min(rate, self.block_size), 1))
            visible.append(w[None, :] < (q_pos + 1) // max(rate, 1))
        return Keys(_pad(slots), _pad(seen), _pad(rows), _pad(visible))

    def emissions(self, rate: int, overlap: bool, state: str) -> Emissions | None:
        """The windows of `rate` that this step's tokens complete; with `overlap` (CSA) each
        mixes the previous window's rows too, read from component `state`. None: no window
        completes."""
        key = ("emissions", rate, overlap, state)
        if key not in self._memo:
            self._memo[key] = self._emissions(rate, overlap, self.pools[state])
        found = self._memo[key]
        assert found is None or isinstance(found, Emissions)
        return found

    def _emissions(self, rate: int, overlap: bool, pool: int) -> Emissions | None:
        width = 2 * rate if overlap else rate
        back = rate if overlap else 0
        slots, valid, first, rows = [], [], [], []
        for seq in self.seqs:
            w = torch.arange(seq.start // rate, seq.end // rate)
            if not len(w):
                continue
            pos = (w * rate - back)[:, None] + torch.arange(width)[None, :]
            slots.append(self.slots(seq, pos.clamp_min(0), pool))
            valid.append(pos >= 0)
            first.append(w * rate)
            rows.append(self.slots(seq, w * rate + rate - 1) // min(rate, self.block_size))
        if not slots:
            return None
        return Emissions(torch.cat(slots), torch.cat(valid), torch.cat(first), torch.cat(rows))


def _pad(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Tensors that differ in their last dim, stacked with zeros (False) after each."""
    width = max(t.shape[-1] for t in tensors)
    return torch.stack([F.pad(t, (0, width - t.shape[-1])) for t in tensors])
