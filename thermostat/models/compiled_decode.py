"""A dense Llama-family model's decode step in one call into the kernels (`DecodeStack` in
thermostat/kernels/decode_stack.h, which both builds compile).

The step runs the same compiled ops, in the same order and with the same arguments, as the
layers' Python forward (thermostat.models.llama), so its hidden states are the same bits; what
goes is the Python between the ops (about 0.1 ms per layer, a quarter of a SmolLM2-135M step at
batch 1 with int8 weights) and, since the threads stay together through the whole step (one
team, thermostat/kernels/decode_stack.h), the fork and join of each op.

It applies to a batch of decode rows only (no prefill chunk) and only where the Python forward
would run every op of a layer in the kernels: linears packed (bf16) or quantized (int8 / int4),
norms, rotary and SwiGLU compiled, and a KV cache in the compute dtype or fp8_e4m3 that the
kernels write and read in place (window pools keep the Python path). Mixture-of-experts layers
keep it too. `compiled_decode` says None wherever one of these fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from thermostat.kernels import CpuOps
from thermostat.models.attention import AttentionMetadata
from thermostat.models.kv_cache import PagedKVCache
from thermostat.models.layers import MLP, DecoderStack, PreNormLayer, RMSNorm
from thermostat.models.linear import PackedLinear, QuantLinear


@dataclass(frozen=True)
class CompiledDecode:
    """The compiled stack of one model over one cache (whose tensors it holds)."""

    stack: Any  # the kernels' DecodeStack

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """x [T, hidden]: the embeddings of T decode rows; cos, sin [T, head_dim]. Returns the
        final hidden states [T, hidden], as the model's forward would."""
        y: torch.Tensor = self.stack.forward(
            x, cos, sin, meta.slot_mapping, meta.decode_block_tables,
            meta.decode_context_lens, meta.sliding_window or 0,
        )  # fmt: skip
        return y


def compiled_decode(model: DecoderStack[Any], cache: PagedKVCache) -> CompiledDecode | None:
    """The compiled decode step of `model` (a thermostat.models.llama.LlamaFamilyModel) over
    `cache`, or None where it does not apply."""
    ops = model.ops
    if (
        ops is None
        or len(cache.spec.pools) != 1
        or not cache.in_place_kernels
        or not _compiled_norm(model.norm)
    ):
        return None
    arch = model.arch
    stack = ops.module.DecodeStack(
        arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.rms_norm_eps,
        arch.head_dim**-0.5, model.norm.weight.detach(),
    )  # fmt: skip
    for i, layer in enumerate(model.layers):
        parts = _layer_parts(layer, i, cache, ops)
        if parts is None:
            return None
        stack.add_layer(parts)
    return CompiledDecode(stack)


def _layer_parts(layer: nn.Module, i: int, cache: PagedKVCache, ops: CpuOps) -> Any | None:
    """Layer i as the kernels' StackLayer, or None if one of its ops is not compiled."""
    if not isinstance(layer, PreNormLayer) or not isinstance(layer.mlp, MLP):
        return None  # a MoE layer
    attn: Any = layer.self_attn  # a thermostat.models.gqa.Attention
    mlp = layer.mlp
    module = ops.module
    if not (
        _compiled_norm(layer.input_layernorm)
        and _compiled_norm(layer.post_attention_layernorm)
        and attn._rotary == ops.rotary
        and mlp._act == ops.silu_mul
    ):
        return None
    linears = [
        _linear(m, module) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    ]
    if any(lin is None for lin in linears):
        return None
    q_norm = None if attn.q_norm is None else attn.q_norm.weight.detach()
    k_norm = None if attn.k_norm is None else attn.k_norm.weight.detach()
    return module.StackLayer(
        layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
        *linears, q_norm, k_norm, *cache.layer_storage(i),
    )  # fmt: skip


def _compiled_norm(norm: nn.Module) -> bool:
    return isinstance(norm, RMSNorm) and norm.compiled


def _linear(m: nn.Module, module: Any) -> Any | None:
    """A projection as the kernels' StackLinear: a bf16 PackedLinear on the kernels (16) or a
    QuantLinear (its bits); None for any other."""
    if isinstance(m, QuantLinear):
        return module.StackLinear(m.weight.packed, m.out_features, m.weight.bits, m.bias)
    if isinstance(m, PackedLinear) and m.ops is not None:
        return module.StackLinear(m.packed, m.out_features, 16, m.bias)
    return None
