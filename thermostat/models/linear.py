"""Linear layers in the weight layouts the kernels read, for every batch size.

bfloat16: with the compiled kernels (thermostat.kernels.LinearOps) a layer keeps one packing,
`pack_vnni`'s, and `linear_vnni` computes every batch, decode and prefill, with one arithmetic:
a row's result never depends on the rows batched with it (batch invariance; oneDNN, which picks
its kernel by batch size, gives the same row different bits at 1, 3 or 64 rows). Without the
kernels, oneDNN with the weight reordered once at load time where oneDNN has bf16 (AVX-512 BW/VL/DQ
or AVX-NE-CONVERT), else nn.Linear. float32 keeps the plain layout (MKL).

int8 / int4 (`--quantization`, thermostat.models.quant): QuantLinear over `linear_quant`, and
QuantEmbedding for the embeddings (the tied LM head's weight too); they need the kernels (either
build: AVX-512 or AVX2).
"""

from __future__ import annotations

import torch
from torch import nn

from thermostat.kernels import LinearOps
from thermostat.models.quant import QuantizedWeight, quantize


def packing_available(dtype: torch.dtype, ops: LinearOps | None) -> bool:
    """Whether a weight of `dtype` is packed: bf16, by the kernels where they run, else by oneDNN
    where its bf16 linear does (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; elsewhere nn.Linear stays)."""
    if dtype != torch.bfloat16:
        return False
    # ignore: torch leaves these two unannotated
    return ops is not None or (
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed once: in the kernels' VNNI layout when they are there, else
    in oneDNN's blocked layout."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, ops: LinearOps | None
    ) -> None:
        super().__init__()
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().clone()
        # The one choice of this op (the table in thermostat.kernels).
        self.ops = ops
        if ops is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # hint: decode
        else:
            self.packed = ops.pack_vnni(weight)

    def float_weight(self) -> torch.Tensor:
        """W [N, K] bf16 back out of the VNNI packing (the layer keeps no plain copy)."""
        if self.ops is None:
            raise ValueError("the weight is in oneDNN's layout (no CPU kernels)")
        nb, ks = self.packed.shape[:2]
        full = self.packed.permute(0, 3, 1, 2, 4).reshape(nb * 16, ks * 32)
        weight: torch.Tensor = full[: self.out_features, : self.in_features].clone()
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if self.ops is None:
            y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                flat, self.packed, self.bias, "none", [], ""
            )
        else:
            y = self.ops.linear_vnni(flat, self.packed, self.out_features, self.bias)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)


class PackedEmbedding(nn.Module):
    """The embedding rows of a tied LM head, read out of its VNNI packing: one copy of the
    table serves both (a SmolLM2-135M's is 57 MB in bf16)."""

    def __init__(self, head: PackedLinear) -> None:
        super().__init__()
        self.head: list[PackedLinear] = [head]  # a list: the head is registered once, as lm_head

    def table(self) -> torch.Tensor:
        """The whole table [vocab, hidden]."""
        return self.head[0].float_weight()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        flat = ids.reshape(-1)
        packed: torch.Tensor = head.packed
        rows = packed[flat // 16, :, :, flat % 16].reshape(len(flat), -1)
        return rows[:, : head.in_features].reshape(*ids.shape, head.in_features)


def pack_linears(module: nn.Module, ops: LinearOps | None = None) -> int:
    """Replace every nn.Linear under `module` by a PackedLinear when the dtype allows it, and let
    modules that pack themselves (MoE experts: `pack_with`) do so. Returns how many linears
    were packed."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and packing_available(child.weight.dtype, ops):
            setattr(module, name, PackedLinear(child.weight, child.bias, ops))
            count += 1
        else:
            count += pack_linears(child, ops)
            pack_with = getattr(child, "pack_with", None)
            if pack_with is not None:
                pack_with(ops)
    return count


class QuantLinear(nn.Module):
    """y = x W^T + b with W in int8 or int4 (thermostat.models.quant), through the kernels'
    `linear_quant` for every batch size (one arithmetic: batch invariant)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, ops: LinearOps) -> None:
        super().__init__()
        self.weight = weight
        self.out_features = weight.out_features
        self.bias = bias
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        y = self.ops.linear_quant(flat.contiguous(), self.weight, self.bias)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)


class QuantEmbedding(nn.Module):
    """Embedding rows read out of a QuantizedWeight [vocab, hidden] (the one a tied LM head
    multiplies by), dequantized to `dtype` as they are gathered (the kernels' `quant_rows`;
    QuantizedWeight.rows is its reference)."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, ops: LinearOps) -> None:
        super().__init__()
        self.weight = weight
        self.dtype = dtype
        self.ops = ops

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.ops.quant_rows(self.weight, ids.reshape(-1).contiguous(), self.dtype)
        return rows.reshape(*ids.shape, self.weight.in_features)


def weight_of(module: nn.Module) -> torch.Tensor:
    """The float weight [N, K] of an nn.Linear or a PackedLinear (which keeps it packed only)."""
    if isinstance(module, PackedLinear):
        return module.float_weight()
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight.detach()


def quantized_linear(linear: nn.Module, fmt: str, ops: LinearOps) -> QuantLinear:
    """An nn.Linear or PackedLinear (weight and bias) as a QuantLinear in `fmt`."""
    source = linear.bias
    bias = source.detach().clone() if isinstance(source, torch.Tensor) else None
    return QuantLinear(quantize(weight_of(linear), fmt, ops), bias, ops)


def quantize_linears(module: nn.Module, fmt: str, ops: LinearOps, skip: tuple[type, ...]) -> int:
    """Replace every nn.Linear / PackedLinear under `module` (not inside a `skip` module, e.g.
    the float32 router) by a QuantLinear in `fmt`. Returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, (nn.Linear, PackedLinear)):
            setattr(module, name, quantized_linear(child, fmt, ops))
            count += 1
        elif not isinstance(child, skip):
            count += quantize_linears(child, fmt, ops, skip)
    return count
