"""DeepSeek-V4 (V4-Flash, V4-Pro) over the paged cache: hyper-connection streams
(thermostat.models.hyper) around V4 attention (thermostat.models.v4_attention) and a MoE block
on every layer.

| layers                             | attention                           | feed-forward          |
|------------------------------------|-------------------------------------|-----------------------|
| `layer_types` sliding_attention    | window only, `main` rope            | routed + 1 shared     |
| compressed_sparse_attention (CSA)  | window + indexer's top-k of 1 per 4 | (`mlp_layer_types`:   |
| heavily_compressed_attention (HCA) | window + all of 1 per 128           | hash_moe or moe)      |

Routing: `hash_moe` layers pick experts by the token id (`tid2eid`), the others by
`scoring_func` (sqrtsoftplus or sigmoid) scores plus the correction bias; the chosen scores are
always normalised, then times `routed_scaling_factor`; every expert and the shared one clamp at
`swiglu_limit`. transformers folds the legacy config keys (`compress_ratios`, `num_hash_layers`,
`qk_rope_head_dim`) into these when it reads config.json.

Cache components (thermostat.models.v4_cache): entries and index keys at their rates in the
main pool; window rows and compressor state per token, each in a window pool that keeps only
the positions a later step reads (the last W - 1 rows, the open windows' state), so any block
boundary is still a valid prefix hit, chunk boundary and handoff.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from thermostat.kernels import CpuOps
from thermostat.models.attention import AttentionMetadata
from thermostat.models.deepseek_v4_names import hf_names
from thermostat.models.hyper import HyperConnection, HyperHead
from thermostat.models.kv_cache import PagedKVCache
from thermostat.models.kv_spec import KVCacheSpec
from thermostat.models.layers import MLP, DecoderStack, Filled, Float32Module, StackArch
from thermostat.models.moe import Experts, MoEArch, Router, expert_target, score
from thermostat.models.v4_attention import Fp32RMSNorm, Tables, V4Attention, V4AttentionArch
from thermostat.models.v4_cache import v4_cache_spec
from thermostat.models.v4_step import V4Step
from thermostat.models.weights import Index, Loaded, gate_up_target

if TYPE_CHECKING:
    from transformers import PretrainedConfig

KINDS = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}


@dataclass(frozen=True)
class V4Arch(StackArch):
    attn: V4AttentionArch
    moe: MoEArch
    kinds: tuple[str, ...]  # per layer: sliding, csa or hca
    rates: dict[str, int]  # csa, hca -> tokens per entry
    hash_layers: tuple[int, ...]
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    sliding_window: int | None = None  # the engine's: V4 attends past its window (entries)

    @classmethod
    def from_config(cls, config: PretrainedConfig, arch: str) -> V4Arch:
        attn = V4AttentionArch(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            head_dim=config.head_dim,
            rope_dim=config.qk_rope_head_dim,
            q_lora_rank=config.q_lora_rank,
            o_groups=config.o_groups,
            o_lora_rank=config.o_lora_rank,
            window=config.sliding_window,
            index_heads=config.index_n_heads,
            index_dim=config.index_head_dim,
            index_topk=config.index_topk,
            rms_norm_eps=config.rms_norm_eps,
        )
        moe = MoEArch(
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            scoring=config.scoring_func,
            norm_topk_prob=True,
            routed_scaling_factor=float(config.routed_scaling_factor),
            correction_bias=True,
            shared_intermediate_size=config.intermediate_size,
            swiglu_limit=config.swiglu_limit,
        )
        if config.scoring_func not in ("sqrtsoftplus", "sigmoid"):
            raise ValueError(f"config.json: scoring_func {config.scoring_func!r} is not served")
        rates = config.compress_rates
        return cls(
            **cls.common_fields(config, arch),
            attn=attn,
            moe=moe,
            kinds=tuple(KINDS[t] for t in config.layer_types),
            rates={
                "csa": rates["compressed_sparse_attention"],
                "hca": rates["heavily_compressed_attention"],
            },
            hash_layers=tuple(i for i, t in enumerate(config.mlp_layer_types) if t == "hash_moe"),
            hc_mult=config.hc_mult,
            hc_sinkhorn_iters=config.hc_sinkhorn_iters,
            hc_eps=config.hc_eps,
        )

    @property
    def rotary_dim(self) -> int:
        return self.attn.rope_dim

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.kinds) if k == kind)


class V4Rope:
    """The two rope tables: `main` (sliding-only layers) and `compress` (CSA/HCA layers, their
    entries and indexer), [max_positions, rd / 2] each, as config.rope_parameters gives them."""

    def __init__(self, config: PretrainedConfig, max_positions: int, dtype: torch.dtype):
        t = torch.arange(max_positions, dtype=torch.float32)
        self.cos: dict[str, torch.Tensor] = {}
        self.sin: dict[str, torch.Tensor] = {}
        for kind in ("main", "compress"):
            params = config.rope_parameters[kind]
            rope_type = params.get("rope_type", "default")
            if rope_type == "default":
                dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
                exponent = torch.arange(0, dim, 2, dtype=torch.float32) / dim
                inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponent), 1.0
            else:
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=kind)
            freqs = torch.outer(t, inv_freq.float())
            self.cos[kind] = (freqs.cos() * scaling).to(dtype)
            self.sin[kind] = (freqs.sin() * scaling).to(dtype)

    def tables(self, positions: torch.Tensor) -> Tables:
        """Both tables at the step's positions, and the whole `compress` table (entries are
        roped at their windows' first positions)."""
        tables = {
            f"{kind}_table": (self.cos[kind][positions], self.sin[kind][positions])
            for kind in ("main", "compress")
        }
        tables["compress_all"] = (self.cos["compress"], self.sin["compress"])
        return tables


class HashRouter(Float32Module):
    """Experts by token id (`tid2eid` [vocab, top_k]), weighted by the learned gate's scores."""

    def __init__(self, moe: MoEArch, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, hidden_size))
        ids = torch.zeros(vocab_size, moe.top_k, dtype=torch.int64)
        self.tid2eid = nn.Parameter(ids, requires_grad=False)

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = score(F.linear(x.float(), self.weight), self.moe)
        ids = self.tid2eid[input_ids]
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.moe.routed_scaling_factor, ids


class V4MoE(nn.Module):
    def __init__(self, a: V4Arch, hashed: bool, ops: CpuOps | None) -> None:
        super().__init__()
        self.gate: nn.Module = (
            HashRouter(a.moe, a.hidden_size, a.vocab_size)
            if hashed
            else Router(a.moe, a.hidden_size)
        )
        self.hashed = hashed
        self.experts = Experts(a.moe, a.hidden_size, ops)
        size, limit = a.moe.shared_intermediate_size, a.moe.swiglu_limit
        self.shared_experts = MLP(a.hidden_size, size, False, ops, limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids) if self.hashed else self.gate(x)
        routed: torch.Tensor = self.experts(x, weights, ids)
        shared: torch.Tensor = self.shared_experts(x)
        return routed + shared


class V4Layer(nn.Module):
    def __init__(self, a: V4Arch, i: int, ops: CpuOps | None) -> None:
        super().__init__()
        kind = a.kinds[i]
        self.self_attn = V4Attention(a.attn, i, kind, a.rates.get(kind, 0))
        self.mlp = V4MoE(a, i in a.hash_layers, ops)
        self.input_layernorm = Fp32RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = Fp32RMSNorm(a.hidden_size, a.rms_norm_eps)
        hc = (a.hc_mult, a.hidden_size, a.hc_sinkhorn_iters, a.hc_eps, a.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(
        self,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        tables: Tables,
        step: V4Step,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        x, post, comb = self.attn_hc.collapse(streams)
        h = self.self_attn(self.input_layernorm(x), tables, step, cache)
        streams = HyperConnection.expand(streams, h, post, comb)
        x, post, comb = self.ffn_hc.collapse(streams)
        y = self.mlp(self.post_attention_layernorm(x), input_ids)
        return HyperConnection.expand(streams, y, post, comb)


class DeepseekV4Model(DecoderStack[V4Arch]):
    """A thermostat.models.registry.CausalLM for DeepseekV4ForCausalLM checkpoints."""

    arch_type = V4Arch

    def _build(self, config: PretrainedConfig, dtype: torch.dtype, max_positions: int) -> None:
        a = self.arch
        self.norm = Fp32RMSNorm(a.hidden_size, a.rms_norm_eps)  # type: ignore[assignment]
        self.hc_head = HyperHead(a.hc_mult, a.hidden_size, a.hc_eps, a.rms_norm_eps)
        self.rope = V4Rope(config, max_positions, dtype)
        self.compute_dtype = dtype
        for name, param in self.named_parameters():
            if name.endswith(("position_bias", "sinks")):  # float32 in every model dtype
                param.data = param.data.float()

    def _layer(self, i: int) -> nn.Module:
        return V4Layer(self.arch, i, self.ops)

    def cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return v4_cache_spec(self.arch, block_size, dtype, self.compute_dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        step = V4Step.of(meta, cache.spec, self.arch.attn.window)
        tables = self.rope.tables(positions)
        x: torch.Tensor = self.embed_tokens(input_ids)
        streams = x[:, None, :].expand(-1, self.arch.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, tables, step, cache)
        hidden: torch.Tensor = self.norm(self.hc_head(streams))
        return hidden

    def load_weights(
        self, tensors: Iterable[tuple[str, Loaded]], filled: Filled | None = None
    ) -> None:
        """DeepSeek's official names, transformers' and save_pretrained's hybrid of the two
        (thermostat.models.deepseek_v4_names); multi-token-prediction layers skipped, logged."""
        super().load_weights(hf_names(tensors), filled)

    def _target(self, name: str) -> tuple[str, Index]:
        name = name.replace(".indexer.scorer.", ".indexer.")
        if expert := expert_target(name, self.arch.moe.intermediate_size):
            return expert
        if ".shared_experts." in name:
            return gate_up_target(name, self.arch.moe.shared_intermediate_size)
        return name, ()
