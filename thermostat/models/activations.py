"""The gated products of the MLPs: [..., 2I] (gate rows first) -> act(gate) * up [..., I]."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from thermostat.kernels import CpuOps


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate first) -> silu(gate) * up [..., I]: the reference of CpuOps.silu_mul."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_silu_mul(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu_mul with the gate clamped to at most `limit` and up to [-limit, limit]
    (DeepSeek-V4's `swiglu_limit`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate first) -> gelu(gate, tanh approximation) * up [..., I] (Gemma's)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gated_activation(
    intermediate: int, limit: float | None, ops: CpuOps | None, act: str = "silu"
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gated product of an MLP of `intermediate` size: SiLU's (clamped at `limit` when
    given, else the compiled kernel where it applies: the table in thermostat.kernels), or
    GELU's tanh approximation (`act` "gelu_pytorch_tanh", PyTorch's)."""
    if act == "gelu_pytorch_tanh":
        return gelu_tanh_mul
    if act != "silu":
        raise ValueError(f"config.json: hidden activation {act!r} is not supported")
    if limit is not None:
        return functools.partial(clamped_silu_mul, limit=limit)
    return ops.silu_mul if ops is not None and intermediate % 16 == 0 else silu_mul
