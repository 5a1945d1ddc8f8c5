"""Gemma 3's text decoder (Gemma3ForCausalLM: 270M, 1B; the text tower of the larger ones) over
the paged KV cache.

What sets it apart from the Llama family (transformers' modeling_gemma3 is the reference):

| part        | Gemma 3                                                                       |
|-------------|-------------------------------------------------------------------------------|
| attention   | local layers attend to the last `sliding_window` positions, global layers to  |
|             | all (`layer_types`); each kind has its own rotary base (`rope_parameters`)    |
| scores      | scaled by `query_pre_attn_scalar ** -0.5`; q and k RMS-normed per head        |
| norms       | x * (1 + w), four per layer: around the attention and around the MLP          |
| embeddings  | multiplied by sqrt(hidden_size), rounded to the model dtype                   |
| MLP         | GELU (tanh approximation) gated                                               |
| logits      | tanh-capped at `final_logit_softcapping` when the config sets it              |

The norms hold 1 + w once loaded (`_finish_loading`), so they run as every RMSNorm does. Every
layer keeps its whole context in the cache; a local layer's queries are masked to their window
(attention.windowed), in the decode kernel as in prefill.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from thermostat.kernels import CpuOps
from thermostat.models.attention import AttentionMetadata, windowed
from thermostat.models.gqa import Attention, AttentionArch, AttentionStack
from thermostat.models.layers import MLP, LayerInputs, PreNormLayer, RMSNorm
from thermostat.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Gemma3Arch(AttentionArch):
    """The shared attention's shape (q/k norms on, no biases, the model-wide sliding window
    None: global layers see everything), and Gemma's own."""

    window: int  # a local layer's, in tokens (its own position included)
    local_layers: tuple[int, ...]
    activation: str
    final_softcap: float | None

    @classmethod
    def from_config(cls, config: PretrainedConfig, arch: str) -> Gemma3Arch:
        if getattr(config, "attn_logit_softcapping", None):
            raise ValueError("config.json: attn_logit_softcapping is not supported")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("config.json: use_bidirectional_attention is not supported")
        kinds = list(config.layer_types)
        return cls(
            **cls.common_fields(config, arch),
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            qkv_bias=False,
            o_bias=False,
            qk_norm=True,
            sliding_window=None,
            attention_scale=config.query_pre_attn_scalar**-0.5,
            window=config.sliding_window,
            local_layers=tuple(i for i, k in enumerate(kinds) if k == "sliding_attention"),
            activation=config.hidden_activation,
            final_softcap=getattr(config, "final_logit_softcapping", None),
        )


def rotary_of(
    config: PretrainedConfig, kind: str, head_dim: int, max_positions: int, dtype: torch.dtype
) -> RotaryEmbedding:
    """The rotary tables of one layer kind ("sliding_attention" or "full_attention")."""
    own = copy.copy(config)
    own.rope_parameters = dict(config.rope_parameters[kind])
    return RotaryEmbedding(own, head_dim, max_positions, dtype)


class Gemma3Layer(PreNormLayer):
    """norm, attention, norm, add; norm, MLP, norm; the residual stream as PreNormLayer keeps it
    (each add fused with the norm that follows it)."""

    def __init__(self, arch: Gemma3Arch, layer: int, ops: CpuOps | None) -> None:
        size, eps = arch.hidden_size, arch.rms_norm_eps
        attn = Attention(arch, layer, ops)
        mlp = MLP(size, arch.intermediate_size, False, ops, act=arch.activation)
        super().__init__(size, eps, attn, mlp, ops)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, ops)
        self.post_feedforward_layernorm = RMSNorm(size, eps, ops)

    def feed_forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = self.pre_feedforward_layernorm.add_forward(self.post_attention_layernorm(h), residual)
        y: torch.Tensor = self.post_feedforward_layernorm(self.mlp(h))
        return y


class Gemma3Model(AttentionStack[Gemma3Arch]):
    """A thermostat.models.registry.CausalLM for Gemma3ForCausalLM checkpoints."""

    arch_type = Gemma3Arch

    def _build(self, config: PretrainedConfig, dtype: torch.dtype, max_positions: int) -> None:
        head_dim = self.arch.head_dim
        self.rotary = rotary_of(config, "full_attention", head_dim, max_positions, dtype)
        self.local_rotary = rotary_of(config, "sliding_attention", head_dim, max_positions, dtype)
        self.embed_scale = torch.tensor(self.arch.hidden_size**0.5, dtype=dtype)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super()._embed(input_ids) * self.embed_scale

    def _inputs(self, positions: torch.Tensor, meta: AttentionMetadata) -> list[LayerInputs]:
        """A local layer's own rotary tables, its queries masked to the window."""
        full = (*self.rotary.tables(positions), meta)
        local = (*self.local_rotary.tables(positions), windowed(meta, self.arch.window))
        return [local if i in self.arch.local_layers else full for i in range(len(self.layers))]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.arch.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _layer(self, i: int) -> nn.Module:
        return Gemma3Layer(self.arch, i, self.ops)

    def _finish_loading(self) -> None:
        """Gemma's norms scale by 1 + w: stored so, they run as any RMSNorm."""
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, RMSNorm):
                    m.weight.add_(1.0)
