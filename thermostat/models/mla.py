"""Multi-head Latent Attention (DeepSeek-V2/V3) over a paged cache of latents.

Per token, with H heads, r = kv_lora_rank, dn / dr = qk_nope / qk_rope head dims, dv = v_head_dim:

| symbol  | what                                                    | shape          |
|---------|---------------------------------------------------------|----------------|
| q       | q_proj(x), or q_b_proj(norm(q_a_proj(x))) with q LoRA   | [H, dn + dr]   |
| c       | kv_a_layernorm(kv_a_proj_with_mqa(x)[:r]): the latent   | [r]            |
| k_pe    | rope(kv_a_proj_with_mqa(x)[r:]): one key part, all heads | [dr]           |
| W_uk    | kv_b_proj rows of the keys: k_nope_h = W_uk[h] c        | [H, dn, r]     |
| W_uv    | kv_b_proj rows of the values: v_h = W_uv[h] c           | [H, dv, r]     |

score_h(t, s) = q_nope_h(t) . W_uk[h] c(s) + q_pe_h(t) . k_pe(s), times `softmax_scale`
(qk_head_dim^-0.5, times mscale^2 under YaRN with `mscale_all_dim`).

The cache stores, per token and layer, one component "latent" = [c, k_pe]: r + dr values
(576 for DeepSeek-V3), not per-head keys and values; under fp8_e4m3 the vector is stored with
one float32 scale. Two forms read it:

| rows     | form     | how                                                                       |
|----------|----------|---------------------------------------------------------------------------|
| decodes  | absorbed | q_lat_h = W_uk[h]^T q_nope_h; one-head attention of [q_lat_h, q_pe_h]     |
|          |          | over [c, k_pe] with values c; o_h = W_uv[h] (attention output)            |
| prefills | expanded | k_h = [W_uk[h] c, k_pe], v_h = W_uv[h] c for the context, then SDPA       |

Rope layout: DeepSeek-V2 (always) and V3 (`rope_interleave`) rotate interleaved pairs
(x0, x1), (x2, x3), ...; `deinterleave_rope_rows` permutes the rows of q's and k_pe's
projections once at load time to the half-split layout, after which the half-split rotary is
exactly transformers' interleaved one (V3's, which writes de-interleaved outputs; V2's complex
product differs from it only by that same permutation of both q and k, which leaves every
q . k unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from thermostat.kernels import CpuOps
from thermostat.models.attention import AttentionMetadata, prefill_runs
from thermostat.models.kv_cache import PagedKVCache
from thermostat.models.layers import RMSNorm
from thermostat.models.rope import apply_rotary


@dataclass(frozen=True)
class MLAArch:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None  # None: one q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    rope_interleave: bool
    attention_bias: bool
    rms_norm_eps: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def deinterleave_rope_rows(weight: torch.Tensor, block: int, rope_start: int) -> torch.Tensor:
    """Rows of a projection [n * block, ...] whose rows [rope_start, block) of every block of
    `block` rows are a rope part in interleaved pairs -> the same rows, each rope part reordered
    evens first then odds (the half-split layout)."""
    dr = block - rope_start
    perm = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)]) + rope_start
    order = torch.cat([torch.arange(rope_start), perm])
    blocks = weight.view(-1, block, *weight.shape[1:])
    return blocks[:, order].reshape(weight.shape)


class MLAttention(nn.Module):
    def __init__(self, mla: MLAArch, layer: int, ops: CpuOps | None) -> None:
        super().__init__()
        self.mla, self.layer = mla, layer
        h, bias = mla.num_heads, mla.attention_bias
        self.q_proj: nn.Module | None = None
        self.q_a_proj: nn.Module | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Module | None = None
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(mla.hidden_size, h * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(mla.hidden_size, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, mla.rms_norm_eps, ops)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, h * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(mla.hidden_size, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, mla.rms_norm_eps, ops)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, h * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(h * mla.v_head_dim, mla.hidden_size, bias=bias)
        # kv_b_proj split per head for the absorbed form (set by `finish_loading`)
        self.w_uk = torch.empty(0)  # [H, dn, r]
        self.w_uv_t = torch.empty(0)  # [H, r, dv]
        # The one choice of this op (the table in thermostat.kernels).
        compiled = ops if mla.qk_rope_head_dim % 32 == 0 else None
        self._rotary = apply_rotary if compiled is None else compiled.rotary

    def finish_loading(self) -> None:
        """After the checkpoint is in, before linears are packed: rope rows to the half-split
        layout where the checkpoint interleaves them, and kv_b_proj split per head."""
        mla = self.mla
        with torch.no_grad():
            if mla.rope_interleave:
                q = self.q_proj if self.q_proj is not None else self.q_b_proj
                assert isinstance(q, nn.Linear)  # built so in __init__
                q.weight.copy_(
                    deinterleave_rope_rows(q.weight, mla.qk_head_dim, mla.qk_nope_head_dim)
                )
                kv_a = self.kv_a_proj_with_mqa
                kv_a.weight.copy_(
                    deinterleave_rope_rows(kv_a.weight, mla.latent_dim, mla.kv_lora_rank)
                )
                if kv_a.bias is not None:
                    bias = deinterleave_rope_rows(kv_a.bias, mla.latent_dim, mla.kv_lora_rank)
                    kv_a.bias.copy_(bias)
            # in the compute dtype (the norms'), even where kv_b_proj is held in float32
            # until it is quantized (weight_format.hold_float32)
            dtype = self.kv_a_layernorm.weight.dtype
            w = self.kv_b_proj.weight.detach().view(mla.num_heads, -1, mla.kv_lora_rank).to(dtype)
            self.w_uk = w[:, : mla.qk_nope_head_dim].clone()
            self.w_uv_t = w[:, mla.qk_nope_head_dim :].transpose(1, 2).contiguous()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        mla, t = self.mla, x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None  # q LoRA: all three built in __init__
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, mla.num_heads, mla.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        q_pe = self._rotary(q_pe, cos, sin)
        kv_a = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(kv_a[:, : mla.kv_lora_rank])
        k_pe = self._rotary(kv_a[:, None, mla.kv_lora_rank :], cos, sin)
        latent = torch.cat([c, k_pe[:, 0]], dim=-1)  # [T, r + dr]
        cache.write(self.layer, (latent,), meta.slot_mapping)

        nd = meta.num_decodes
        out = x.new_empty(t, mla.num_heads, mla.v_head_dim)
        if nd:
            out[:nd] = self._decode(q_nope[:nd], q_pe[:nd], meta, cache)
        if meta.prefills:
            query = torch.cat([q_nope[nd:], q_pe[nd:]], dim=-1)
            out[nd:] = self._prefill(query, latent[nd:], meta, cache)
        y: torch.Tensor = self.o_proj(out.flatten(1))
        return y

    def _decode(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache
    ) -> torch.Tensor:
        """Absorbed form: q_nope, q_pe [nd, H, dn|dr] -> [nd, H, dv]."""
        (ctx,) = cache.gather(self.layer, meta.decode_block_tables)  # [nd, L, r + dr]
        r = self.mla.kv_lora_rank
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk)  # [H, nd, r]
        query = torch.cat([q_lat.transpose(0, 1), q_pe], dim=-1)  # [nd, H, r + dr]
        o = F.scaled_dot_product_attention(
            query.unsqueeze(1),  # [nd, 1, H, r + dr]: the heads as the query rows of one head
            ctx.unsqueeze(1),
            ctx[..., :r].unsqueeze(1),
            attn_mask=meta.decode_mask,  # [nd, 1, 1, L]
            scale=self.mla.softmax_scale,
        )  # [nd, 1, H, r]
        return torch.bmm(o[:, 0].transpose(0, 1), self.w_uv_t).transpose(0, 1)

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [L, r + dr] -> keys [L, H, dn + dr], values [L, H, dv]."""
        mla, n = self.mla, latent.shape[0]
        kv = self.kv_b_proj(latent[:, : mla.kv_lora_rank]).view(n, mla.num_heads, -1)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k_pe = latent[:, None, mla.kv_lora_rank :].expand(n, mla.num_heads, mla.qk_rope_head_dim)
        return torch.cat([k_nope, k_pe], dim=-1), v

    def _prefill(
        self,
        query: torch.Tensor,
        latent: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """Expanded form over the prefill rows: query [Tp, H, dn + dr], their latents [Tp, r + dr]
        -> [Tp, H, dv]. A fresh sequence attends to its own new latents (unless the cache is
        quantized: then every context is read back from the cache, as decodes read it)."""
        scale = self.mla.softmax_scale
        out = query.new_empty(query.shape[0], self.mla.num_heads, self.mla.v_head_dim)
        for run in prefill_runs(meta.prefills, 0, cache.spec.quantized):
            start, end, seg = run.start, run.end, run.segment
            if seg is None:  # fresh sequences: their own new latents are the context
                k, v = self._expand(latent[start:end])
            else:
                (ctx,) = cache.gather(self.layer, seg.block_table)
                k, v = self._expand(ctx[0, : seg.ctx_len])
            out[start:end] = run.attend(query[start:end], k, v, scale, enable_gqa=False)
        return out
