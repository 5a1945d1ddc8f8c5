"""DeepSeek-V2 and DeepSeek-V3 decoders (also V2-Lite, R1, Kimi-K2: the same architectures)
over the paged latent cache: Multi-head Latent Attention (thermostat.models.mla) and the MoE
block (thermostat.models.moe).

| layers                         | feed-forward                                             |
|--------------------------------|----------------------------------------------------------|
| [0, first_k_dense_replace)     | dense SiLU-gated MLP of `intermediate_size`              |
| [first_k_dense_replace, L)     | routed experts + `n_shared_experts` shared (one MLP)     |
| L and up, in a checkpoint      | multi-token-prediction (next-n) layers: loaded for       |
|                                | `--speculative mtp` (thermostat.models.next_n), else     |
|                                | skipped and logged                                       |

Routing by architecture: V2 softmax top-k (`topk_method` greedy, or group_limited_greedy ranking
groups by their best expert); V3 sigmoid scores plus `e_score_correction_bias` for the choice,
groups ranked by their two best, weights normalised when `norm_topk_prob`, then scaled by
`routed_scaling_factor`.

DeepSeek's own fp8 checkpoints (V3/R1: float8_e4m3fn weights with 128x128 block scales) load
through thermostat.models.fp8_weights: dequantized once to the serving dtype, so they take that
dtype's memory (bfloat16: twice the fp8 files) and run at its speed.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from thermostat.models.attention import AttentionMetadata
from thermostat.models.kv_cache import PagedKVCache
from thermostat.models.kv_spec import CacheComponent, KVCacheSpec
from thermostat.models.layers import MLP, DecoderStack, Filled, StackArch
from thermostat.models.mla import MLAArch, MLAttention
from thermostat.models.moe import MoEArch, SparseMoE, expert_target
from thermostat.models.next_n import NextNLayer, next_n_name
from thermostat.models.rope import rope_parameters
from thermostat.models.weights import Index, Loaded, gate_up_target

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger("thermostat.models")

_LAYER = re.compile(r"layers\.(\d+)\.")


def yarn_softmax_scale(config: PretrainedConfig, qk_head_dim: int) -> float:
    """qk_head_dim^-0.5, times mscale^2 (0.1 * mscale_all_dim * ln(factor) + 1, squared) when a
    scaled rope declares `mscale_all_dim` and a factor above 1."""
    scale: float = qk_head_dim**-0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim") or 0
    factor = params.get("factor") or 1.0
    if params["rope_type"] != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


@dataclass(frozen=True)
class DeepseekArch(StackArch):
    """The family's shape from a Hugging Face config.json."""

    mla: MLAArch
    moe: MoEArch | None  # None: every layer dense
    first_k_dense_replace: int
    sliding_window: int | None = None
    num_next_n: int = 0  # next-n (MTP) layers built: the checkpoint's, when asked for

    @classmethod
    def from_config(cls, config: PretrainedConfig, arch: str) -> DeepseekArch:
        v3 = arch == "DeepseekV3ForCausalLM"
        qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        mla = MLAArch(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            softmax_scale=yarn_softmax_scale(config, qk_head_dim),
            rope_interleave=bool(getattr(config, "rope_interleave", True)) if v3 else True,
            attention_bias=bool(getattr(config, "attention_bias", False)),
            rms_norm_eps=config.rms_norm_eps,
        )
        return cls(
            **cls.common_fields(config, arch),
            mla=mla,
            moe=_moe_arch(config, v3),
            first_k_dense_replace=getattr(config, "first_k_dense_replace", None) or 0,
            num_next_n=int(getattr(config, "num_nextn_predict_layers", 0) or 0) if v3 else 0,
        )

    @property
    def rotary_dim(self) -> int:
        return self.mla.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.first_k_dense_replace


def _moe_arch(config: PretrainedConfig, v3: bool) -> MoEArch | None:
    if not getattr(config, "n_routed_experts", None):
        return None
    groups = getattr(config, "n_group", None) or 1
    if not v3 and getattr(config, "topk_method", "greedy") != "group_limited_greedy":
        groups = 1  # V2 "greedy": no group limit
    shared = (getattr(config, "n_shared_experts", None) or 0) * config.moe_intermediate_size
    return MoEArch(
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        scoring="sigmoid" if v3 else "softmax",
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
        routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
        num_groups=groups,
        topk_groups=(getattr(config, "topk_group", None) or groups) if groups > 1 else 1,
        group_score="top2_sum" if v3 else "max",
        correction_bias=v3,
        shared_intermediate_size=shared,
    )


class DeepseekModel(DecoderStack[DeepseekArch]):
    """A thermostat.models.registry.CausalLM for DeepseekV2ForCausalLM and
    DeepseekV3ForCausalLM checkpoints."""

    arch_type = DeepseekArch

    def _build(self, config: PretrainedConfig, dtype: torch.dtype, max_positions: int) -> None:
        a = self.arch
        self.num_next_n = a.num_next_n
        if self.num_next_n:
            self.next_n = nn.ModuleList(
                NextNLayer(
                    a.hidden_size,
                    a.vocab_size,
                    a.rms_norm_eps,
                    self._layer(a.num_layers + j),
                    self.ops,
                )
                for j in range(self.num_next_n)
            )
            self._settle(dtype)

    @torch.inference_mode()
    def draft(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """The first next-n layer over a step's rows (it writes its cache slots at every row):
        `hidden` [T, H] the main model's output, `next_ids` [T] each row's next token; returns
        its logits [len(rows), vocab] float32 at `rows` (for the token after that next token)."""
        cos, sin = self.rotary.tables(positions)
        layer = cast(NextNLayer, self.next_n[0])
        h = layer(hidden, self.embed_tokens(next_ids), cos, sin, meta, cache)
        if not len(rows):
            return torch.empty(0, self.arch.vocab_size)
        logits: torch.Tensor = layer.head(h[rows])
        return logits.float()

    def _layer(self, i: int) -> nn.Module:
        a, ops = self.arch, self.ops
        moe = None
        if a.moe is not None and a.is_moe_layer(i):
            size = a.moe.shared_intermediate_size
            shared = MLP(a.hidden_size, size, a.mlp_bias, ops) if size else None
            moe = SparseMoE(a.moe, a.hidden_size, ops, shared)
        return self._pre_norm_layer(MLAttention(a.mla, i, ops), moe)

    def cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """One "latent" of [kv_lora_rank + qk_rope_head_dim] per token and layer."""
        latent = CacheComponent("latent", (self.arch.mla.latent_dim,), dtype)
        return KVCacheSpec(self.arch.num_layers + self.arch.num_next_n, block_size, (latent,))

    def load_weights(
        self, tensors: Iterable[tuple[str, Loaded]], filled: Filled | None = None
    ) -> None:
        """Per-expert or fused experts; gate/up fused at load. Layers past num_hidden_layers
        (multi-token prediction) load into `next_n` when it was built, else are skipped and
        logged."""
        skipped: set[int] = set()
        first, built = self.arch.num_layers, self.arch.num_layers + self.arch.num_next_n

        def main_layers() -> Iterator[tuple[str, Loaded]]:
            for hf_name, tensor in tensors:
                name = hf_name.removeprefix("model.")
                layer = _LAYER.match(name)
                if layer is None or int(layer[1]) < first:
                    yield hf_name, tensor
                elif int(layer[1]) < built:
                    if (own := next_n_name(name, first)) is not None:
                        yield own, tensor
                else:
                    skipped.add(int(layer[1]))

        super().load_weights(main_layers(), filled)
        if skipped:
            log.info("checkpoint: skipped multi-token-prediction layers %s", sorted(skipped))

    def _finish_loading(self) -> None:
        for m in self.modules():
            if isinstance(m, MLAttention):
                m.finish_loading()

    def _target(self, name: str) -> tuple[str, Index]:
        moe = self.arch.moe
        if moe is not None and (expert := expert_target(name, moe.intermediate_size)):
            return expert
        if moe is not None and ".shared_experts." in name:
            return gate_up_target(name, moe.shared_intermediate_size)
        return gate_up_target(name, self.arch.intermediate_size)
