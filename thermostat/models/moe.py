"""The mixture-of-experts feed-forward block of every MoE family served (Mixtral, Qwen3-MoE,
DeepSeek-V2, DeepSeek-V3): a float32 router picks `top_k` of E experts per token; each chosen
expert is a SiLU-gated MLP; their outputs are summed with the router's weights, plus the shared
experts (a dense MLP every token takes) where the family has them.

Routing, per token, in float32 (`route`, a pure function):

| step           | softmax (Mixtral, Qwen3-MoE, DeepSeek-V2) | sigmoid (DeepSeek-V3)             |
|----------------|-------------------------------------------|-----------------------------------|
| scores s       | softmax(logits)                           | sigmoid(logits); DeepSeek-V4:     |
|                |                                           | sqrt(softplus(logits))            |
| choice c       | s                                         | s + e_score_correction_bias       |
| group limit    | keep `topk_group` of `n_group` groups,    | ranked by the sum of each group's |
| (n_group > 1)  | ranked by each group's max c              | two largest c                     |
| experts        | the top_k of c among the kept groups      | same                              |
| weights        | s of the chosen experts; divided by their sum when `norm_topk_prob`;    |
|                | times `routed_scaling_factor`                                           |

DeepSeek-V4 clamps every expert's (and the shared expert's) gate at `swiglu_limit` and its up
projection to [-limit, limit] before the SiLU product.

Experts run grouped: the T * top_k (token, expert) pairs are sorted by expert, each expert that
has rows runs once on them, and the weighted outputs are added back per token in float32. No
expert computes a token it was not chosen for.

Weights, as transformers 5.x holds them: `experts.gate_up_proj` [E, 2I, H] (gate rows first) and
`experts.down_proj` [E, H, I]. Checkpoints store either those (fused) or one tensor per expert,
`experts.{e}.gate_proj|up_proj|down_proj.weight` (Mixtral: `w1|w3|w2`); `expert_target` maps the
per-expert names to slices of the fused parameters.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from thermostat.kernels import CpuOps, LinearOps
from thermostat.models.activations import gated_activation
from thermostat.models.layers import Float32Module
from thermostat.models.linear import PackedLinear, QuantLinear
from thermostat.models.quant import QuantizedWeight, quantize
from thermostat.models.weights import Index


@dataclass(frozen=True)
class MoEArch:
    """One family's MoE block, from its config.json."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    scoring: Literal["softmax", "sigmoid", "sqrtsoftplus"]
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    num_groups: int = 1  # n_group; 1: no group limit
    topk_groups: int = 1  # topk_group
    group_score: Literal["max", "top2_sum"] = "max"
    correction_bias: bool = False  # e_score_correction_bias (DeepSeek-V3)
    shared_intermediate_size: int = 0  # the shared experts as one MLP; 0: none
    swiglu_limit: float | None = None  # DeepSeek-V4's clamp of gate and up

    def __post_init__(self) -> None:
        if self.num_experts % self.num_groups:
            raise ValueError(f"{self.num_experts} experts do not split into {self.num_groups}")
        if self.top_k > self.num_experts // self.num_groups * self.topk_groups:
            raise ValueError(f"top_k={self.top_k} exceeds the experts of the kept groups")


def score(logits: torch.Tensor, moe: MoEArch) -> torch.Tensor:
    """The router's scores of logits [T, E] float32 (what the chosen experts are weighted by)."""
    if moe.scoring == "sigmoid":
        return logits.sigmoid()
    if moe.scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return logits.softmax(dim=-1)


def route(
    logits: torch.Tensor, moe: MoEArch, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 -> (weights [T, top_k] float32, expert ids [T, top_k] int64)."""
    scores = score(logits, moe)
    choice = scores if bias is None else scores + bias
    if moe.num_groups > 1 and moe.topk_groups < moe.num_groups:
        per_group = moe.num_experts // moe.num_groups
        grouped = choice.view(-1, moe.num_groups, per_group)
        if moe.group_score == "top2_sum":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        kept = group_scores.topk(moe.topk_groups, dim=-1).indices
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, kept, False)
        choice = choice.masked_fill(dropped.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = choice.topk(moe.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


class Router(Float32Module):
    """Router logits in float32 (its parameters stay float32 whatever the model dtype)."""

    def __init__(self, moe: MoEArch, hidden_size: int) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, hidden_size))
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(moe.num_experts)) if moe.correction_bias else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        return route(logits, self.moe, self.e_score_correction_bias)


class Experts(nn.Module):
    def __init__(self, moe: MoEArch, hidden_size: int, ops: CpuOps | None) -> None:
        super().__init__()
        e, i = moe.num_experts, moe.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(e, hidden_size, i))
        self._act = gated_activation(i, moe.swiglu_limit, ops)
        self.num_experts = e
        # once packed (bf16 with the kernels) or quantized: per expert [gate_up, down] as
        # PackedLinear / QuantLinear, the fused float parameters dropped; None: those parameters
        self.per_expert: nn.ModuleList | None = None

    def pack_with(self, ops: LinearOps | None) -> None:
        """bf16 with the kernels: each expert's projections as PackedLinears (one arithmetic
        for any batch, as every dense layer); otherwise the float parameters stay."""
        if self.per_expert is not None or ops is None or self.gate_up_proj.dtype != torch.bfloat16:
            return  # (already quantized as a checkpoint stores them: weight_format)
        self._split(lambda w: PackedLinear(w, None, ops))

    def quantize(
        self,
        fmt: str,
        ops: LinearOps,
        stored: tuple[list[QuantizedWeight], ...] | None = None,
    ) -> None:
        """Every expert's two projections in `fmt`, or as the checkpoint stores them (`stored`:
        each expert's gate_up and down weights; a GGUF file's blocks). Packed experts are left
        to the caller's pass over the model's PackedLinears."""
        if self.per_expert is not None:
            return
        if stored is None:
            self._split(lambda w: QuantLinear(quantize(w, fmt, ops), None, ops))
            return
        gate_up, down = stored
        self.per_expert = nn.ModuleList(
            nn.ModuleList([QuantLinear(gate_up[e], None, ops), QuantLinear(down[e], None, ops)])
            for e in range(self.num_experts)
        )
        del self.gate_up_proj, self.down_proj

    def _split(self, make: Callable[[torch.Tensor], nn.Module]) -> None:
        gate_up, down = self.gate_up_proj.detach(), self.down_proj.detach()
        self.per_expert = nn.ModuleList(
            nn.ModuleList([make(gate_up[e]), make(down[e])]) for e in range(self.num_experts)
        )
        del self.gate_up_proj, self.down_proj

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.per_expert is not None:
            pair = self.per_expert[e]
            assert isinstance(pair, nn.ModuleList)
            y: torch.Tensor = pair[1](self._act(pair[0](x)))
            return y
        return F.linear(self._act(F.linear(x, self.gate_up_proj[e])), self.down_proj[e])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights, ids [T, top_k] -> sum over k of weight * expert(x) [T, H]."""
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # pairs grouped by expert, tokens in order
        rows = order // ids.shape[1]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = x.index_select(0, rows)
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                ys[start : start + n] = self._expert(e, xs[start : start + n])
            start += n
        out = torch.zeros(x.shape, dtype=torch.float32)
        out.index_add_(0, rows, ys.float() * weights.flatten()[order, None])
        return out.to(x.dtype)


class SparseMoE(nn.Module):
    """Routed experts plus, when given, `shared_experts` (a dense MLP on every token)."""

    def __init__(
        self,
        moe: MoEArch,
        hidden_size: int,
        ops: CpuOps | None,
        shared_experts: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.gate = Router(moe, hidden_size)
        self.experts = Experts(moe, hidden_size, ops)
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        y: torch.Tensor = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


_PER_EXPERT = re.compile(r"(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight")
_PROJ = {  # checkpoint projection -> (fused parameter, which half of gate_up; None: down)
    "gate_proj": ("gate_up_proj", 0),
    "w1": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "w3": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w2": ("down_proj", None),
}


def expert_target(name: str, intermediate_size: int) -> tuple[str, Index] | None:
    """A per-expert checkpoint name (`...experts.{e}.{proj}.weight`) -> (fused parameter name,
    index of that expert's slice in it); None for any other name."""
    match = _PER_EXPERT.fullmatch(name)
    if match is None or match["proj"] not in _PROJ:
        return None
    param, half = _PROJ[match["proj"]]
    expert = int(match["expert"])
    target = f"{match['prefix']}.{param}"
    if half is None:
        return target, (expert,)
    return target, (expert, slice(half * intermediate_size, (half + 1) * intermediate_size))
