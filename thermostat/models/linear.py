"""Linear layers in the weight layouts that are fastest for the dtype and batch on this CPU.

bfloat16, measured on the SmolLM2-135M shapes (2 threads, all weights once): for decode batches
the compiled kernels (thermostat.kernels: `linear_vnni` over a weight packed once by
`pack_vnni`) beat oneDNN: 1-2 rows stream the weights at copy bandwidth (10-12 ms vs 29 ms),
3-32 rows use AMX tiles (M=8: 19 vs 39 ms, M=32: 23 vs 34 ms). From about 64 rows (prefill)
oneDNN with the weight reordered once at load time is faster. So with the kernels a bf16 layer
keeps both packings (the second costs the layer's size once more). float32 keeps the plain
layout (MKL is already at the bandwidth bound).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn


def packing_available(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """y = x W^T + b with W in oneDNN's blocked layout, and in the kernels' VNNI layout too when
    they are there to use it (for batches up to `kernels.vnni_max_rows()` rows)."""

    def __init__(self, linear: nn.Linear, kernels: ModuleType | None) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # hint: decode shape
        self.kernels = kernels
        self.vnni = kernels.pack_vnni(weight) if kernels is not None else None
        self.vnni_rows = kernels.vnni_max_rows() if kernels is not None else 0
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if flat.shape[0] <= self.vnni_rows:
            y = self.kernels.linear_vnni(flat, self.vnni, self.out_features, self.bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)


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
