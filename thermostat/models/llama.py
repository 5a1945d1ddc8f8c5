"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache, and the MoE
families on the same attention (Mixtral, Qwen3-MoE: thermostat.models.moe in place of the MLP on
their MoE layers).

Weights are fused at load time: q/k/v into one projection, gate/up into another, so a layer is
four matrix products."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from thermostat.kernels import CpuOps
from thermostat.models.attention import AttentionMetadata, paged_attention
from thermostat.models.kv_cache import KVCacheSpec, PagedKVCache
from thermostat.models.linear import pack_linears
from thermostat.models.moe import MoEArch, SparseMoE, expert_target, keep_routers_float32
from thermostat.models.rope import RotaryEmbedding, apply_rotary
from thermostat.models.weights import ParameterFiller

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class ModelArch:
    """The family's shape from a Hugging Face config.json (an ArchFacts for the engine)."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    max_position_embeddings: int
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
            architecture=arch,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False)),
            o_bias=arch != "Qwen2ForCausalLM" and bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=qwen3,
            sliding_window=window,
            max_position_embeddings=config.max_position_embeddings,
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


class RMSNorm(nn.Module):
    """RMSNorm accumulating in float32 and rounding once (transformers rounds to the model dtype
    once more before scaling: identical in float32, within an ulp in bfloat16). With `ops` the
    input is [N, dim] rows; without, any shape ending in dim."""

    def __init__(self, dim: int, eps: float, ops: CpuOps | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # The one choice of this op (the table in thermostat.kernels).
        compiled = ops if dim % 16 == 0 else None
        self._norm = _rms_norm if compiled is None else compiled.rms_norm
        self._add_norm = _add_rms_norm if compiled is None else compiled.add_rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x (in place, rounded to the dtype as `residual + x` is); returns
        norm(residual)."""
        return self._add_norm(x, residual, self.weight, self.eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def _add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    residual.add_(x)
    return F.rms_norm(residual, weight.shape, weight, eps)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate first) -> silu(gate) * up [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, ops: CpuOps | None) -> None:
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
        self.scale = arch.head_dim**-0.5
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


class MLP(nn.Module):
    """SiLU-gated MLP, gate and up fused into one projection (gate rows first)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, ops: CpuOps | None):
        super().__init__()
        self.intermediate = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        # The one choice of this op (the table in thermostat.kernels).
        compiled = ops if self.intermediate % 16 == 0 else None
        self._act = _silu_mul if compiled is None else compiled.silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.down_proj(self._act(self.gate_up_proj(x)))
        return y


class PreNormLayer(nn.Module):
    """A decoder layer's data flow, shared by the families: norm, attention, add + norm, MLP
    (dense or MoE). Subclasses build the four parts."""

    input_layernorm: RMSNorm
    self_attn: nn.Module
    post_attention_layernorm: RMSNorm
    mlp: nn.Module

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to `residual` (None before the first
        layer, where x is the embedding). Returns (this layer's output, residual): the residual
        stream is updated in place, each add fused with the norm that follows it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, sin, meta, cache)
        h = self.post_attention_layernorm.add_forward(h, residual)
        y: torch.Tensor = self.mlp(h)
        return y, residual


class DecoderLayer(PreNormLayer):
    def __init__(self, arch: ModelArch, layer: int, ops: CpuOps | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.self_attn = Attention(arch, layer, ops)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.mlp: nn.Module
        if arch.moe is not None and layer in arch.moe_layers:
            self.mlp = SparseMoE(arch.moe, arch.hidden_size, ops)
        else:
            self.mlp = MLP(arch.hidden_size, arch.intermediate_size, arch.mlp_bias, ops)


class DecoderStack(nn.Module):
    """What every family's model shares: embeddings, a stack of layers that each take and
    return (hidden, residual), the final add + norm, the LM head. Subclasses build the parts."""

    rotary: RotaryEmbedding
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: RMSNorm
    lm_head: nn.Linear

    def _build_ends(
        self, vocab_size: int, hidden_size: int, rms_norm_eps: float, tie: bool, ops: CpuOps | None
    ) -> None:
        """The embeddings, final norm and LM head (tied to the embeddings when `tie`)."""
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.norm = RMSNorm(hidden_size, rms_norm_eps, ops)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        if tie:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden]."""
        cos, sin = self.rotary.tables(positions)
        x: torch.Tensor = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, meta, cache)
        assert residual is not None  # set by the first layer
        return self.norm.add_forward(x, residual)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()


class LlamaFamilyModel(DecoderStack):
    """A thermostat.models.registry.CausalLM for Llama, Mistral, Qwen2, Qwen3, Mixtral and
    Qwen3-MoE checkpoints."""

    def __init__(
        self,
        arch: ModelArch,
        config: PretrainedConfig,
        dtype: torch.dtype,
        max_positions: int,
        ops: CpuOps | None = None,
    ) -> None:
        """`ops`: thermostat.kernels.ops() to run the ops it takes in the compiled kernels; None
        for the pure-PyTorch path."""
        super().__init__()
        self.arch = arch
        self.ops = ops
        a = arch
        self._build_ends(a.vocab_size, a.hidden_size, a.rms_norm_eps, a.tie_word_embeddings, ops)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, ops) for i in range(arch.num_layers))
        self.rotary = RotaryEmbedding(config, arch.head_dim, max_positions, dtype)
        self.to(dtype)
        keep_routers_float32(self)
        self.eval()

    @classmethod
    def arch_from_config(cls, config: PretrainedConfig, architecture: str) -> ModelArch:
        return ModelArch.from_config(config, architecture)

    def cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """A key and a value of [num_kv_heads, head_dim] per token and layer."""
        a = self.arch
        return KVCacheSpec.key_value(a.num_layers, a.num_kv_heads, a.head_dim, block_size, dtype)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face parameter names, fusing q/k/v and gate/up (and experts stored one
        by one, Mixtral's `block_sparse_moe` read as `mlp`). Raises ValueError naming any
        missing, unexpected or misshapen parameter."""
        a = self.arch
        q, kv, i = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
        fused = {  # checkpoint projection -> (fused parameter, its rows there)
            "q_proj": ("qkv_proj", slice(0, q)),
            "k_proj": ("qkv_proj", slice(q, q + kv)),
            "v_proj": ("qkv_proj", slice(q + kv, q + 2 * kv)),
            "gate_proj": ("gate_up_proj", slice(0, i)),
            "up_proj": ("gate_up_proj", slice(i, 2 * i)),
        }
        filler = ParameterFiller(self)
        for hf_name, tensor in tensors:
            name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and a.tie_word_embeddings:
                continue  # tied: some checkpoints store the copy anyway
            target = None if a.moe is None else expert_target(name, a.moe.intermediate_size)
            if target is None:
                target = name, ()
                for src, (dst, rows) in fused.items():
                    if f".{src}." in name:
                        target = name.replace(f".{src}.", f".{dst}."), (rows,)
                        break
            param, index = target
            filler.copy(param, tensor, index, hf_name)
        filler.check_complete()
        pack_linears(self, self.ops)
