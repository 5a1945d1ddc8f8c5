"""DeepSeek-V4 attention over the paged cache: one shared K=V row per token, a sliding window on
every layer, plus compressed entries on CSA layers (one per 4 tokens, chosen per query by the
lightning indexer) and HCA layers (one per 128, all visible).

Per token, H heads of D (512 in V4-Flash), rope on the last rd (64) values in interleaved pairs:

| symbol | what                                                                     | shape     |
|--------|--------------------------------------------------------------------------|-----------|
| q_res  | q_a_norm(q_a_proj(x)) (the indexer reads it too)                         | [q_lora]  |
| q      | rope(unweighted_norm(q_b_proj(q_res)) per head)                          | [H, D]    |
| kv     | rope(kv_norm(kv_proj(x))): key and value at once                         | [D]       |
| entry  | rope_w(kv_norm(sum_j softmax_j(gate_j + bias_j) kv_j)) over a window     | [D]       |
| out    | softmax over [window; entries; the head's sink logit] times the rows,    | [H, D]    |
|        | its rope slice rotated back by the query's position, then o_a per group  |           |
|        | of heads (block diagonal) and o_b                                        |           |

Sliding-only layers rope with the `main` table; CSA/HCA layers (their queries, window rows,
entries and indexer) with the `compress` one. An entry is roped at its window's first position.
CSA's compressor (and the indexer's) projects 2D per token: entry w mixes the first halves of
window w - 1 and the second halves of window w (8 rows at rate 4).

Cache components (thermostat.models.v4_cache declares them): the window rows as `kv_nope`
(the cache dtype, fp8 allowed) and `kv_rope` (the model dtype, as SGLang keeps the rope part in
bf16), the per-token compressor projections `<kind>_state` (model dtype, the inputs of windows
not yet complete), entries `<kind>_nope`/`<kind>_rope` and the indexer's keys `index`, at their
rates. Where a step reads and writes them: thermostat.models.v4_step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from thermostat.models.hyper import unweighted_rms_norm
from thermostat.models.kv_cache import PagedKVCache
from thermostat.models.layers import Float32Module
from thermostat.models.v4_step import Emissions, V4Step

# "main_table", "compress_table": cos, sin [T, rd / 2] at the step's positions;
# "compress_all": the whole compress table [max_positions, rd / 2]
Tables = dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class V4AttentionArch:
    hidden_size: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    index_heads: int
    index_dim: int
    index_topk: int
    rms_norm_eps: float


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] with its last 2 * cos.shape[-1] values rotated in interleaved pairs (computed
    in float32); cos, sin broadcast against x[..., :rd / 2]."""
    rd = 2 * cos.shape[-1]
    pairs = x[..., -rd:].float().reshape(*x.shape[:-1], rd // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos.float(), sin.float()
    rotated = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rotated.to(x.dtype)], dim=-1)


class Fp32RMSNorm(Float32Module):
    """RMSNorm with its weight in float32, applied in float32 and rounded once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)


class Compressor(nn.Module):
    """Mixes each window of `rate` tokens into one entry of `dim` (with `overlap`, the
    previous window's first halves too). `position_bias` stays float32."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = Fp32RMSNorm(dim, eps)

    @property
    def state_width(self) -> int:
        """Values kept per token until its windows are complete: kv and gate."""
        return 4 * self.dim if self.overlap else 2 * self.dim

    def state(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)

    def compress(self, state: torch.Tensor, em: Emissions, tables: Tables) -> torch.Tensor:
        """state [N, width, state_width] of each completed window -> entries [N, dim]."""
        kv, gate = state.chunk(2, dim=-1)
        r, d = self.rate, self.dim
        bias = self.position_bias.repeat(state.shape[1] // r, 1)  # [width, kv width]
        gate = gate + bias  # float32 from here, as the reference
        if self.overlap:  # slots [0, r): the previous window's first halves; [r, 2r): ours
            kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
            gate = torch.cat([gate[:, :r, :d], gate[:, r:, d:]], dim=1)
        valid = em.valid[..., None]
        kv = kv.masked_fill(~valid, 0.0)
        gate = gate.masked_fill(~valid, float("-inf"))
        mixed = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        cos, sin = tables["compress_all"]
        return rope_tail(self.kv_norm(mixed), cos[em.first], sin[em.first])


class Indexer(Compressor):
    """The lightning indexer of a CSA layer: a compressor of index_dim keys of its own; a
    query's score of entry s is sum_h w_h * relu(q_h . k_s) / sqrt(index_dim)."""

    def __init__(self, a: V4AttentionArch, rate: int) -> None:
        super().__init__(a.hidden_size, a.index_dim, rate, True, a.rms_norm_eps)
        self.a = a
        self.q_b_proj = nn.Linear(a.q_lora_rank, a.index_heads * a.index_dim, bias=False)
        self.weights_proj = nn.Linear(a.hidden_size, a.index_heads, bias=False)

    def queries(
        self, x: torch.Tensor, q_res: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(roped queries [T, Hi, Di] float32, head weights [T, Hi] float32)."""
        a = self.a
        q = self.q_b_proj(q_res).view(-1, a.index_heads, a.index_dim)
        q = rope_tail(q, cos[:, None], sin[:, None]).float()
        return q, self.weights_proj(x).float() * a.index_heads**-0.5

    def choose(
        self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """q [B, n, Hi, Di], w [B, n, Hi], keys [B, E, Di], visible [B, n, E] -> chosen
        [B, n, E] bool: each query's top index_topk visible entries by score."""
        b, n, h, _ = q.shape
        dots = torch.matmul(q.reshape(b, n * h, -1), keys.float().transpose(1, 2))
        scores = F.relu(dots.view(b, n, h, -1)) * self.a.index_dim**-0.5
        scores = (scores * w[..., None]).sum(dim=2).masked_fill(~visible, float("-inf"))
        # a stable sort, not topk: equal scores (all heads' relu at 0 is common with few heads)
        # go to the earlier entry whatever the batch's shape, so batching never changes a pick
        k = min(self.a.index_topk, keys.shape[1])
        top = scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]
        return torch.zeros_like(visible).scatter_(2, top, True) & visible


def attend(
    q: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, n, H, D] over rows [B, K, D] (keys and values) where visible [B, n, K], with one
    sink logit per head in the softmax's denominator -> [B, n, H, D]."""
    b, n, h, d = q.shape
    logits = torch.matmul(q.reshape(b, n * h, d), rows.transpose(1, 2)).view(b, n, h, -1)
    logits = (logits * scale).masked_fill(~visible[:, :, None, :], float("-inf"))
    sink = sinks.view(1, 1, -1, 1).expand(b, n, -1, 1).to(logits.dtype)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = combined.float().softmax(dim=-1)[..., :-1].to(rows.dtype)
    return torch.matmul(probs.view(b, n * h, -1), rows).view(b, n, h, d)


class V4Attention(nn.Module):
    """One layer's attention. kind: "sliding", "csa" or "hca" (rate > 0 for the last two)."""

    def __init__(self, a: V4AttentionArch, layer: int, kind: str, rate: int) -> None:
        super().__init__()
        self.a, self.layer, self.kind, self.rate = a, layer, kind, rate
        h, d = a.num_heads, a.head_dim
        self.q_a_proj = nn.Linear(a.hidden_size, a.q_lora_rank, bias=False)
        self.q_a_norm = Fp32RMSNorm(a.q_lora_rank, a.rms_norm_eps)
        self.q_b_proj = nn.Linear(a.q_lora_rank, h * d, bias=False)
        self.kv_proj = nn.Linear(a.hidden_size, d, bias=False)
        self.kv_norm = Fp32RMSNorm(d, a.rms_norm_eps)
        # o_a: one [o_lora, H/g * D] block per group of heads, stored stacked as transformers
        self.o_a_proj = _Grouped(h * d // a.o_groups, a.o_groups * a.o_lora_rank, a.o_groups)
        self.o_b_proj = nn.Linear(a.o_groups * a.o_lora_rank, a.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(h))
        self.compressor: CompressedKV | None = None
        if kind != "sliding":
            self.compressor = CompressedKV(a, kind, rate)
        self.table = "main_table" if kind == "sliding" else "compress_table"

    def forward(
        self, x: torch.Tensor, tables: Tables, step: V4Step, cache: PagedKVCache
    ) -> torch.Tensor:
        a, t, layer = self.a, x.shape[0], self.layer
        cos, sin = tables[self.table]
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_res).view(t, a.num_heads, a.head_dim)
        q = rope_tail(unweighted_rms_norm(q, a.rms_norm_eps), cos[:, None], sin[:, None])
        kv = rope_tail(self.kv_norm(self.kv_proj(x)), cos, sin)
        cache.put("kv_nope", layer, kv[:, : -a.rope_dim], step.new_slots("kv_nope"))
        cache.put("kv_rope", layer, kv[:, -a.rope_dim :], step.new_slots("kv_rope"))
        index_q = None
        if self.compressor is not None:
            self.compressor.update(x, layer, tables, step, cache)
            if self.compressor.indexer is not None:
                index_q = self.compressor.indexer.queries(x, q_res, cos, sin)
        out = q.new_empty(t, a.num_heads, a.head_dim)
        scale = a.head_dim**-0.5
        for span, members in step.groups():
            b = len(members)
            keys = step.keys(members, self.rate)
            rows = _rows(cache, "kv", layer, keys.window_slots)  # [B, K, D]
            visible = keys.window_visible
            if self.compressor is not None:
                seen = keys.entry_visible
                indexer = self.compressor.indexer
                if indexer is not None and index_q is not None and seen.shape[-1]:
                    qi, wi = index_q[0][span], index_q[1][span]
                    index_keys = cache.take("index", layer, keys.entry_rows)
                    seen = indexer.choose(
                        qi.view(b, -1, *qi.shape[1:]),
                        wi.view(b, -1, wi.shape[-1]),
                        index_keys,
                        seen,
                    )
                rows = torch.cat([rows, _rows(cache, self.kind, layer, keys.entry_rows)], dim=1)
                visible = torch.cat([visible, seen], dim=2)
            o = attend(
                q[span].view(b, -1, a.num_heads, a.head_dim), rows, visible, self.sinks, scale
            )
            out[span] = o.flatten(0, 1)
        out = rope_tail(out, cos[:, None], -sin[:, None])
        grouped = self.o_a_proj(out.view(t, a.o_groups, -1))
        y: torch.Tensor = self.o_b_proj(grouped.flatten(1))
        return y


class CompressedKV(Compressor):
    """A CSA or HCA layer's compressor (with CSA's indexer): stores each new token's projections,
    then turns every window this step completes into its entry (and index key)."""

    def __init__(self, a: V4AttentionArch, kind: str, rate: int) -> None:
        super().__init__(a.hidden_size, a.head_dim, rate, kind == "csa", a.rms_norm_eps)
        self.kind = kind
        self.indexer = Indexer(a, rate) if kind == "csa" else None
        self.rope_dim = a.rope_dim

    @property
    def cached_state_width(self) -> int:
        """The `<kind>_state` row: this compressor's kv and gate, then the indexer's."""
        extra = 0 if self.indexer is None else self.indexer.state_width
        return self.state_width + extra

    def update(
        self, x: torch.Tensor, layer: int, tables: Tables, step: V4Step, cache: PagedKVCache
    ) -> None:
        parts = [self.state(x)]
        if self.indexer is not None:
            parts.append(self.indexer.state(x))
        state_name = f"{self.kind}_state"
        cache.put(state_name, layer, torch.cat(parts, dim=-1), step.new_slots(state_name))
        em = step.emissions(self.rate, self.overlap, state_name)
        if em is None:
            return
        state = cache.take(state_name, layer, em.slots)
        own = self.state_width
        entries = self.compress(state[..., :own], em, tables)
        cache.put(f"{self.kind}_nope", layer, entries[:, : -self.rope_dim], em.rows)
        cache.put(f"{self.kind}_rope", layer, entries[:, -self.rope_dim :], em.rows)
        if self.indexer is not None:
            keys = self.indexer.compress(state[..., own:], em, tables)
            cache.put("index", layer, keys, em.rows)


class _Grouped(nn.Module):
    """Block-diagonal linear: [T, g, in] -> [T, g, out / g], group i through rows
    [i * out / g, (i + 1) * out / g) of `weight` [out, in]."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.zeros(out_features, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, -1, x.shape[-1]).transpose(1, 2)  # [g, in, out/g]
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


def _rows(cache: PagedKVCache, prefix: str, layer: int, rows: torch.Tensor) -> torch.Tensor:
    """A row's nope and rope parts, read and joined: [len(rows), D]."""
    nope = cache.take(f"{prefix}_nope", layer, rows)
    return torch.cat([nope, cache.take(f"{prefix}_rope", layer, rows)], dim=-1)
