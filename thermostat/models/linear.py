"""Linear layers in the weight layout that is fastest for the dtype on this CPU.

bfloat16 matrix-vector products through the default path reach about half the memory
bandwidth; oneDNN with a weight reordered once at load time (blocked for AMX/AVX-512) gets close
to it, for decode batches and prefill alike, with identical results. float32 keeps the plain
layout (MKL is already at the bound).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def packing_available(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout (opaque, read-only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.out_features = weight.shape[0]
        # batch-size hint 1: the decode shape; measured as fast as any hint for larger batches
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear under `module` by a PackedLinear when the dtype allows it.
    Returns how many were packed."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and packing_available(child.weight.dtype):
            setattr(module, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count


def linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """Apply an nn.Linear or a PackedLinear."""
    return layer(x) if isinstance(layer, PackedLinear) else F.linear(x, layer.weight, layer.bias)
