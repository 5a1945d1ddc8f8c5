"""Linear layers in the weight layouts that are fastest for the dtype and batch on this CPU.

bfloat16, measured on the SmolLM2-135M shapes: for decode batches the compiled kernels
(thermostat.kernels.CpuOps: `linear_vnni` over a weight packed once by `pack_vnni`) beat oneDNN:
1-2 rows stream the weights at copy bandwidth, 3-32 rows use AMX tiles. From about 64 rows
(prefill) oneDNN with the weight reordered once at load time is faster. So with the kernels a
bf16 layer keeps both packings (the second costs the layer's size once more). float32 keeps the
plain layout (MKL is already at the bandwidth bound).
"""

from __future__ import annotations

import torch
from torch import nn

from thermostat.kernels import CpuOps


def packing_available(dtype: torch.dtype) -> bool:
    # ignore: torch leaves mkldnn.is_available unannotated
    return dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]


class PackedLinear(nn.Module):
    """y = x W^T + b with W in oneDNN's blocked layout, and in the kernels' VNNI layout too when
    they are there to use it (for batches of up to `vnni_rows` rows)."""

    def __init__(self, linear: nn.Linear, ops: CpuOps | None) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # hint: decode shape
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        # The one choice of this op (the table in thermostat.kernels).
        self.ops = ops
        self.vnni = None if ops is None else ops.pack_vnni(weight)
        self.vnni_rows = 0 if ops is None else ops.vnni_max_rows()
        self._linear = self._onednn if ops is None else self._vnni_or_onednn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        y = self._linear(flat)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def _onednn(self, flat: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            flat, self.packed, self.bias, "none", [], ""
        )
        return y

    def _vnni_or_onednn(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.shape[0] > self.vnni_rows:
            return self._onednn(flat)
        assert self.ops is not None and self.vnni is not None  # __init__: this path only with ops
        return self.ops.linear_vnni(flat, self.vnni, self.out_features, self.bias)


def pack_linears(module: nn.Module, ops: CpuOps | None = None) -> int:
    """Replace every nn.Linear under `module` by a PackedLinear when the dtype allows it.
    Returns how many were packed."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and packing_available(child.weight.dtype):
            setattr(module, name, PackedLinear(child, ops))
            count += 1
        else:
            count += pack_linears(child, ops)
    return count
