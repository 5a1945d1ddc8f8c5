"""Linear layers in the weight layouts that are fastest for the dtype and batch on this CPU.

bfloat16, measured on the SmolLM2-135M shapes (2 threads): for one or two rows (decode of one
or two sequences) the compiled kernel (thermostat.kernels.linear_bf16, which streams the plain
[out, in] weight once) is the fastest; for more rows oneDNN with the weight reordered once at
load time (blocked for AMX) is, prefill most of all. So with the kernels a bf16 layer keeps both
layouts (the plain one costs the layer's size once more; a tied LM head shares the embedding's).
float32 keeps the plain layout (MKL is already at the bandwidth bound).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

# Rows up to which the compiled few-row kernel beats oneDNN (measured; see the docstring).
FEW_ROWS = 2


def packing_available(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """y = x W^T + b with W in oneDNN's blocked layout, and in the plain layout too when the
    few-row kernel is there to use it."""

    def __init__(self, linear: nn.Linear, kernels: ModuleType | None) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # hint: decode shape
        self.kernels = kernels
        self.weight = weight.contiguous() if kernels is not None else None
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.kernels is not None and flat.shape[0] <= FEW_ROWS:
            y = self.kernels.linear_bf16(flat.contiguous(), self.weight, self.bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


def pack_linears(module: nn.Module, kernels: ModuleType | None = None) -> int:
    """Replace every nn.Linear under `module` by a PackedLinear when the dtype allows it.
    Returns how many were packed."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and packing_available(child.weight.dtype):
            setattr(module, name, PackedLinear(child, kernels))
            count += 1
        else:
            count += pack_linears(child, kernels)
    return count
