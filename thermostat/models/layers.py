"""The layer library every family builds on: RMSNorm, the gated MLP (its products:
models/activations.py), the pre-norm decoder layer, and `DecoderStack` (embeddings, layers,
final norm, LM head; the constructor tail and the checkpoint loop every family shares). A family
module imports these, never another family."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from thermostat.kernels import CpuOps
from thermostat.models.activations import gated_activation
from thermostat.models.attention import AttentionMetadata
from thermostat.models.kv_cache import PagedKVCache
from thermostat.models.linear import PackedEmbedding, PackedLinear, pack_linears
from thermostat.models.rope import RotaryEmbedding
from thermostat.models.weights import (
    Index,
    Loaded,
    ParameterFiller,
    Sources,
    empty_parameters,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


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

    @property
    def compiled(self) -> bool:
        """Whether the norm runs in the compiled kernels."""
        return self._norm is not _rms_norm

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


class MLP(nn.Module):
    """Gated MLP (SiLU, or Gemma's GELU), gate and up fused into one projection (gate rows
    first)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        ops: CpuOps | None,
        limit: float | None = None,
        act: str = "silu",
    ):
        super().__init__()
        self.intermediate = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self._act = gated_activation(intermediate_size, limit, ops, act)
        # the compiled SiLU: fused into a packed gate/up linear (the table in thermostat.kernels)
        self._swiglu = ops if ops is not None and self._act == ops.silu_mul else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up: nn.Module = self.gate_up_proj
        if (
            self._swiglu is not None
            and isinstance(gate_up, PackedLinear)
            and gate_up.ops is not None
            and x.dim() == 2
        ):  # the same bits, the [T, 2I] product not written out
            act = self._swiglu.linear_swiglu(x, gate_up.packed, self.intermediate, gate_up.bias)
        else:
            act = self._act(gate_up(x))
        y: torch.Tensor = self.down_proj(act)
        return y


class PreNormLayer(nn.Module):
    """A decoder layer's data flow, shared by the families: norm, attention, add + norm, MLP
    (dense or MoE). `self_attn` is called as (h, cos, sin, meta, cache) -> [T, hidden]."""

    def __init__(
        self, hidden_size: int, eps: float, attn: nn.Module, mlp: nn.Module, ops: CpuOps | None
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps, ops)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, ops)
        self.mlp = mlp

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
        return self.feed_forward(self.self_attn(h, cos, sin, meta, cache), residual), residual

    def feed_forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The attention's output `h` added to the residual stream (in place), normed, through
        the MLP."""
        y: torch.Tensor = self.mlp(self.post_attention_layernorm.add_forward(h, residual))
        return y


class Float32Module(nn.Module):
    """A module whose parameters stay float32 whatever the model dtype (a MoE router):
    `DecoderStack` casts them back after its `.to(dtype)`."""


@dataclass(frozen=True)
class StackArch:
    """What every family reads alike from a Hugging Face config.json (`common_fields`); each
    family's arch (an ArchFacts for the engine) extends it."""

    architecture: str  # the config's architectures entry served
    hidden_size: int
    num_layers: int
    intermediate_size: int  # of the dense MLPs
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    mlp_bias: bool
    max_position_embeddings: int

    @classmethod
    def from_config(cls, config: PretrainedConfig, arch: str) -> StackArch:
        """The family's arch; ValueError or AttributeError for a config it cannot serve."""
        raise NotImplementedError

    @staticmethod
    def common_fields(config: PretrainedConfig, architecture: str) -> dict[str, Any]:
        return dict(
            architecture=architecture,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            max_position_embeddings=config.max_position_embeddings,
        )

    @property
    def rotary_dim(self) -> int:
        """The head dim of the rotary tables."""
        raise NotImplementedError


A = TypeVar("A", bound=StackArch)
# a loaded module's path and its parameters' checkpoint tensors -> whether it was replaced
Filled = Callable[[str, Sources], bool]
LayerInputs = tuple[torch.Tensor, torch.Tensor, AttentionMetadata]  # cos, sin, meta


class DecoderStack(nn.Module, Generic[A]):
    """What every family's model shares: embeddings, a stack of layers that each take and
    return (hidden, residual), the final add + norm, the LM head (tied to the embeddings when
    the arch says so). A family names its arch in `arch_type`, builds its layers in `_layer`
    and maps checkpoint names in `_target`."""

    arch_type: type[StackArch]

    def __init__(
        self,
        arch: A,
        config: PretrainedConfig,
        dtype: torch.dtype,
        max_positions: int,
        ops: CpuOps | None = None,
    ) -> None:
        """The constructor of every family (registry.CausalLM). `ops`: thermostat.kernels.ops()
        to run the ops it takes in the compiled kernels, None for the pure-PyTorch path."""
        super().__init__()
        self.arch = arch
        self.ops = ops
        self.embed_tokens: nn.Module = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.layers = nn.ModuleList(self._layer(i) for i in range(arch.num_layers))
        self.rotary = RotaryEmbedding(config, arch.rotary_dim, max_positions, dtype)
        self._settle(dtype)
        self._build(config, dtype, max_positions)

    @classmethod
    def arch_from_config(cls, config: PretrainedConfig, architecture: str) -> A:
        return cast(A, cls.arch_type.from_config(config, architecture))

    def _build(self, config: PretrainedConfig, dtype: torch.dtype, max_positions: int) -> None:
        """What a family adds to the constructor, after the shared parts are settled (what it
        builds here keeps the dtype it is made in)."""

    def _settle(self, dtype: torch.dtype) -> None:
        """Every parameter an untouched tensor in `dtype` (a Float32Module's in float32): no
        memory is used before `load_weights` fills them. Eval mode."""
        empty_parameters(self, lambda _: dtype)
        for m in self.modules():
            if isinstance(m, Float32Module):
                empty_parameters(m, lambda _: torch.float32)
        self.eval()

    def _layer(self, i: int) -> nn.Module:
        """Layer i, called as (x, residual, cos, sin, meta, cache) -> (x, residual)."""
        raise NotImplementedError

    def _pre_norm_layer(self, attn: nn.Module, moe: nn.Module | None) -> PreNormLayer:
        """A PreNormLayer of `attn` and `moe`, or the dense MLP where there is none."""
        a = self.arch
        mlp = MLP(a.hidden_size, a.intermediate_size, a.mlp_bias, self.ops) if moe is None else moe
        return PreNormLayer(a.hidden_size, a.rms_norm_eps, attn, mlp, self.ops)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden]."""
        x = self._embed(input_ids)
        residual: torch.Tensor | None = None
        for layer, inputs in zip(self.layers, self._inputs(positions, meta), strict=True):
            x, residual = layer(x, residual, *inputs, cache)
        assert residual is not None  # set by the first layer
        return self.norm.add_forward(x, residual)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input."""
        x: torch.Tensor = self.embed_tokens(input_ids)
        return x

    def _inputs(self, positions: torch.Tensor, meta: AttentionMetadata) -> list[LayerInputs]:
        """Each layer's rotary tables at `positions` and attention metadata, in layer order."""
        return [(*self.rotary.tables(positions), meta)] * len(self.layers)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()

    def load_weights(
        self, tensors: Iterable[tuple[str, Loaded]], filled: Filled | None = None
    ) -> None:
        """Hugging Face names (a `model.` prefix dropped, rotary tables and a tied LM head's copy
        skipped) into the parameters `_target` names, then `_finish_loading` and the linears
        packed. Raises ValueError naming any missing, unexpected or misshapen parameter.
        `filled(path, sources)` is called with each module whose parameters are all loaded, as
        soon as they are, and where its checkpoint tensors went; it returns whether it replaced
        the module (which this then lets go of: its Deferred tensors are never made)."""
        filler = ParameterFiller(self)
        for hf_name, tensor in tensors:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.arch.tie_word_embeddings):
                continue  # tied: some checkpoints store the copy anyway
            param, index = self._target(name)
            filler.copy(param, tensor, index, hf_name)
            owner = param.rpartition(".")[0]
            if filled is not None and filler.owner_complete(owner):
                if filled(owner, filler.sources_of(owner)):
                    filler.release(owner)
                else:
                    filler.materialize(owner)
        filler.materialize()
        filler.check_complete()
        self._finish_loading()
        pack_linears(self, self.ops)
        head = self.lm_head
        if self.arch.tie_word_embeddings and isinstance(head, PackedLinear) and self.ops:
            self.embed_tokens = PackedEmbedding(head)  # rows read out of the VNNI packing

    def _target(self, name: str) -> tuple[str, Index]:
        """A checkpoint name (no `model.` prefix) -> (parameter name, index into it)."""
        return name, ()

    def _finish_loading(self) -> None:
        """After every parameter is filled, before the linears are packed."""
