"""Checkpoint tensors into a model's parameters: whole, or into a slice of a fused parameter
(q/k/v rows of one projection, gate/up rows, one expert of a stacked [E, ...] tensor).

A parameter counts as loaded when the elements copied into it add up to its size; a checkpoint
never stores one element twice, so that is the completeness check for fused parameters too.
"""

from __future__ import annotations

import torch
from torch import nn

Index = tuple[int | slice, ...]  # where a checkpoint tensor goes in its parameter; () = all


class ParameterFiller:
    """Copies into `module`'s parameters by name; ValueError naming an unexpected or misshapen
    tensor, and (`check_complete`) any parameter left short."""

    def __init__(self, module: nn.Module) -> None:
        self.params = dict(module.named_parameters())
        self.filled = dict.fromkeys(self.params, 0)

    def copy(self, name: str, tensor: torch.Tensor, index: Index = (), hf_name: str = "") -> None:
        """`tensor` into parameter `name` at `index`; `hf_name` (the checkpoint's name) for
        messages."""
        hf_name = hf_name or name
        if name not in self.params:
            raise ValueError(f"checkpoint: unexpected parameter {hf_name}")
        target = self.params[name].detach()
        target = target[index] if index else target
        if target.shape != tensor.shape:
            raise ValueError(
                f"checkpoint: {hf_name} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        target.copy_(tensor)
        self.filled[name] += tensor.numel()

    def check_complete(self) -> None:
        missing = sorted(n for n, p in self.params.items() if self.filled[n] < p.numel())
        if missing:
            raise ValueError(f"checkpoint: missing parameters {missing[:5]}")
