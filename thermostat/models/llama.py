"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache, and the MoE
families on the same attention (Mixtral, Qwen3-MoE: thermostat.models.moe in place of the MLP on
their MoE layers).

Weights are fused at load time: q/k/v into one projection, gate/up into another, so a layer is
four matrix products."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from thermostat.models.attention import AttentionMetadata
from thermostat.models.compiled_decode import CompiledDecode, compiled_decode
from thermostat.models.gqa import Attention, AttentionArch, AttentionStack
from thermostat.models.kv_cache import PagedKVCache
from thermostat.models.moe import MoEArch, SparseMoE, expert_target
from thermostat.models.weights import Index

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class ModelArch(AttentionArch):
    """The family's shape from a Hugging Face config.json."""

    moe: MoEArch | None = None  # Mixtral, Qwen3-MoE
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is `moe`

    @classmethod
    def from_config(cls, config: PretrainedConfig, arch: str) -> ModelArch:
        """`arch`: the config's architecture name, one the registry maps to this family."""
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        window = getattr(config, "sliding_window", None)
        if arch == "Qwen2ForCausalLM" and not getattr(config, "use_sliding_window", False):
            window = None
        qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        if qwen3 and not getattr(config, "use_sliding_window", False):
            window = None
        moe, moe_layers = _moe_arch(config, arch)
        return cls(
            **cls.common_fields(config, arch),
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False)),
            o_bias=arch != "Qwen2ForCausalLM" and bool(getattr(config, "attention_bias", False)),
            qk_norm=qwen3,
            sliding_window=window,
            attention_scale=None,
            moe=moe,
            moe_layers=moe_layers,
        )


def _moe_arch(config: PretrainedConfig, arch: str) -> tuple[MoEArch | None, tuple[int, ...]]:
    """Mixtral: every layer MoE, experts of `intermediate_size`, weights renormalised. Qwen3-MoE:
    experts of `moe_intermediate_size` on the layers not in `mlp_only_layers` that
    `decoder_sparse_step` picks."""
    layers = range(config.num_hidden_layers)
    if arch == "MixtralForCausalLM":
        moe = MoEArch(
            config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
            "softmax", norm_topk_prob=True,
        )  # fmt: skip
        return moe, tuple(layers)
    if arch == "Qwen3MoeForCausalLM" and config.num_experts > 0:
        moe = MoEArch(
            config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            "softmax", norm_topk_prob=bool(config.norm_topk_prob),
        )  # fmt: skip
        dense, step = set(config.mlp_only_layers or ()), config.decoder_sparse_step
        return moe, tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
    return None, ()


class LlamaFamilyModel(AttentionStack[ModelArch]):
    """A thermostat.models.registry.CausalLM for Llama, Mistral, Qwen2, Qwen3, Mixtral and
    Qwen3-MoE checkpoints."""

    arch_type = ModelArch
    _compiled: tuple[PagedKVCache, CompiledDecode | None] | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """A batch of decode rows runs in one compiled call where it applies
        (thermostat.models.compiled_decode: the same bits); anything else layer by layer."""
        if not meta.prefills and meta.num_decodes and self.ops is not None:
            if self._compiled is None or self._compiled[0] is not cache:
                self._compiled = (cache, compiled_decode(self, cache))
            step = self._compiled[1]
            if step is not None:
                cos, sin = self.rotary.tables(positions)
                return step(self.embed_tokens(input_ids), cos, sin, meta)
        return super().forward(input_ids, positions, meta, cache)

    def _layer(self, i: int) -> nn.Module:
        a, ops = self.arch, self.ops
        moe = None
        if a.moe is not None and i in a.moe_layers:
            moe = SparseMoE(a.moe, a.hidden_size, ops)
        return self._pre_norm_layer(Attention(a, i, ops), moe)

    def _target(self, name: str) -> tuple[str, Index]:
        """Experts stored one by one into their stacked parameters, Mixtral's `block_sparse_moe`
        read as `mlp`; the rest as AttentionStack fuses them."""
        moe = self.arch.moe
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if moe is not None and (expert := expert_target(name, moe.intermediate_size)):
            return expert
        return super()._target(name)
