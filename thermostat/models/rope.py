"""Rotary position embeddings: inverse frequencies as the checkpoint's config declares them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def rope_parameters(config: PretrainedConfig) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention scaling). Scaled types (linear, llama3, yarn,
    dynamic, longrope) are computed by transformers' own table from the config. A GGUF file's
    llama3 rope comes as `frequency_factors` (its rope_freqs tensor): each frequency divided by
    its factor, as llama.cpp computes it."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    factors = params.get("frequency_factors")
    if rope_type == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponent), 1.0
    elif rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"config.json: unsupported rope type {rope_type!r}")
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    if factors is not None:
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding:
    """cos/sin tables for positions [0, max_positions), indexed once per step."""

    def __init__(
        self, config: PretrainedConfig, head_dim: int, max_positions: int, dtype: torch.dtype
    ) -> None:
        inv_freq, scaling = inverse_frequencies(config, head_dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * scaling).to(dtype)  # [max_positions, head_dim]
        self.sin = (emb.sin() * scaling).to(dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of `positions` [T] as [T, head_dim]."""
        return self.cos[positions], self.sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] rotated in the half-split layout Hugging Face checkpoints use; cos, sin:
    [T, D]. Returns a new tensor (the PyTorch reference of CpuOps.rotary, which rotates in
    place)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
