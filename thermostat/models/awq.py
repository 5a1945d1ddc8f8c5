"""AWQ checkpoints (AutoAWQ; config.json quantization_config quant_method awq), version gemm:
X.qweight, X.qzeros (packed along the outputs in AWQ's nibble order), X.scales per linear layer
X (thermostat.models.int_packing has the packing). Served in int4."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from thermostat.models.int_packing import (
    awq_columns,
    contiguous_groups,
    dequantize_groups,
    unpack_int32,
)
from thermostat.models.packed_linears import (
    PackedLinears,
    groups_name,
    int4_or_int8,
    layer_part,
    refuse,
)


@dataclass(frozen=True)
class AWQ(PackedLinears):
    """AutoAWQ checkpoints, version gemm (4-bit, zero point)."""

    group_size: int

    @classmethod
    def from_config(cls, quant: dict[str, Any]) -> AWQ:
        bits = quant.get("bits", quant.get("w_bit"))
        group_size = quant.get("group_size", quant.get("q_group_size"))
        version = str(quant.get("version", "gemm")).lower()
        if bits != 4:
            raise refuse("bits", bits, "4-bit AWQ")
        if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
            raise refuse("group_size", group_size, "a positive group size or -1")
        if version != "gemm":
            raise refuse("version", quant.get("version"), "AWQ's 'gemm' packing")
        if quant.get("zero_point", True) is not True:
            raise refuse("zero_point", quant["zero_point"], "AWQ with zero points")
        if quant.get("backend") not in (None, "autoawq"):
            raise refuse("backend", quant["backend"], "AutoAWQ's packing ('autoawq')")
        return cls(group_size)

    @property
    def serve_as(self) -> str:
        return int4_or_int8(4, self.group_size, act_order=False)

    @property
    def source(self) -> str:
        return f"awq 4-bit {groups_name(self.group_size)}"

    def part(self, name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
        return layer_part(name, ("qweight", "qzeros", "scales"))

    def parts(self, layer: str) -> tuple[frozenset[str], frozenset[str]]:
        return frozenset({"qweight", "qzeros", "scales"}), frozenset()

    def dequantize(self, layer: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        q = awq_columns(unpack_int32(parts["qweight"], 4, dim=1)).T  # [N, K]
        zeros = awq_columns(unpack_int32(parts["qzeros"], 4, dim=1)).T  # [N, G]
        scales = parts["scales"].T
        if zeros.shape != scales.shape:
            raise ValueError(f"qzeros hold {tuple(zeros.shape)} zeros for scales {scales.shape}")
        g_idx = contiguous_groups(q.shape[1], self.group_size)
        if int(g_idx.max()) >= scales.shape[1]:
            raise ValueError(f"{scales.shape[1]} groups of {self.group_size} do not cover K")
        return dequantize_groups(q, zeros, scales, g_idx)
