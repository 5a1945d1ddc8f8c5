"""Grouped-query attention over the paged KV cache, the layer the Llama family (Llama, Mistral,
Qwen2, Qwen3, Mixtral, Qwen3-MoE) and Gemma 3 share: q/k/v fused into one projection, optional
biases and per-head q/k norms, rotary, paged attention, the output projection; and what a
family's stack on it shares (`AttentionStack`: its cache, its checkpoint's fused projections)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from thermostat.kernels import CpuOps
from thermostat.models.attention import AttentionMetadata, paged_attention
from thermostat.models.kv_cache import PagedKVCache
from thermostat.models.kv_spec import KVCacheSpec
from thermostat.models.layers import DecoderStack, RMSNorm, StackArch
from thermostat.models.rope import apply_rotary
from thermostat.models.weights import Index, fused_target


@dataclass(frozen=True)
class AttentionArch(StackArch):
    """The attention's shape."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    sliding_window: int | None  # the model's, for every layer (None: all positions)
    attention_scale: float | None  # the scores' scale; None: head_dim ** -0.5

    @property
    def rotary_dim(self) -> int:
        return self.head_dim


class Attention(nn.Module):
    def __init__(self, arch: AttentionArch, layer: int, ops: CpuOps | None) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
        )
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(
            arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        # q/k norms see [T, H, D]: always the PyTorch norm
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, None) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, None) if arch.qk_norm else None
        self.scale = arch.attention_scale or arch.head_dim**-0.5
        # The one choice of this op (the table in thermostat.kernels).
        compiled = ops if arch.head_dim % 32 == 0 else None
        self._rotary = apply_rotary if compiled is None else compiled.rotary

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat(
                [self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1
            )
        qk = self._rotary(qk, cos, sin)  # q and k heads together: one pass
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        o = paged_attention(q, k, v, self.layer, cache, meta, self.scale)
        y: torch.Tensor = self.o_proj(o.reshape(t, self.q_size))
        return y


AA = TypeVar("AA", bound=AttentionArch)


class AttentionStack(DecoderStack[AA]):
    """A family on this attention: its cache and its checkpoint's fused projections."""

    def cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """A key and a value of [num_kv_heads, head_dim] per token and layer."""
        a = self.arch
        return KVCacheSpec.key_value(a.num_layers, a.num_kv_heads, a.head_dim, block_size, dtype)

    def _target(self, name: str) -> tuple[str, Index]:
        """q/k/v fused into qkv_proj, gate/up into gate_up_proj."""
        a = self.arch
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        return fused_target(name, q, kv, a.intermediate_size)
