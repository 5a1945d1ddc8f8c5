"""GPTQ checkpoints (AutoGPTQ, GPTQModel; config.json quantization_config quant_method gptq), 4-
and 8-bit: X.qweight, X.qzeros, X.scales, X.g_idx per linear layer X (thermostat.models.int_packing
has the packing). Served in int4 (4-bit) or int8 (8-bit, or desc_act: the groups scattered along K
by g_idx mix inside a block of 32, which int8 holds within half a step and int4 would not)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from thermostat.models.int_packing import contiguous_groups, dequantize_groups, unpack_int32
from thermostat.models.packed_linears import (
    PackedLinears,
    groups_name,
    int4_or_int8,
    layer_part,
    refuse,
)


@dataclass(frozen=True)
class GPTQ(PackedLinears):
    """AutoGPTQ / GPTQModel checkpoints (4- or 8-bit)."""

    bits: int
    group_size: int  # -1: one group per output row
    act_order: bool  # desc_act without static_groups: g_idx scatters the groups
    zeros_minus_one: bool  # checkpoint_format gptq (v1) stores z - 1; gptq_v2 stores z

    @classmethod
    def from_config(cls, quant: dict[str, Any]) -> GPTQ:
        bits, group_size = quant.get("bits"), quant.get("group_size", -1)
        if bits not in (4, 8):
            raise refuse("bits", bits, "4- and 8-bit GPTQ; 2- and 3-bit have no engine format")
        if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
            raise refuse("group_size", group_size, "a positive group size or -1")
        fmt = quant.get("checkpoint_format", quant.get("format")) or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            field = "checkpoint_format" if "checkpoint_format" in quant else "format"
            raise refuse(field, fmt, "'gptq' and 'gptq_v2' packing")
        if quant.get("is_marlin_format"):
            raise refuse("is_marlin_format", True, "'gptq' and 'gptq_v2' packing")
        if str(quant.get("pack_dtype") or "int32").removeprefix("torch.") != "int32":
            raise refuse("pack_dtype", quant["pack_dtype"], "int32 words")
        if quant.get("dynamic"):
            raise refuse("dynamic", quant["dynamic"], "one bits / group_size for every layer")
        act_order = bool(quant.get("desc_act")) and not quant.get("static_groups")
        return cls(bits, group_size, act_order, zeros_minus_one=fmt == "gptq")

    @property
    def serve_as(self) -> str:
        return int4_or_int8(self.bits, self.group_size, self.act_order)

    @property
    def source(self) -> str:
        order = " act-order" if self.act_order else ""
        return f"gptq {self.bits}-bit {groups_name(self.group_size)}{order}"

    def part(self, name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
        return layer_part(name, ("qweight", "qzeros", "scales", "g_idx"))

    def parts(self, layer: str) -> tuple[frozenset[str], frozenset[str]]:
        return frozenset({"qweight", "qzeros", "scales"}), frozenset({"g_idx"})

    def dequantize(self, layer: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        q = unpack_int32(parts["qweight"], self.bits, dim=0).T  # [N, K]
        n, k = q.shape
        zeros = unpack_int32(parts["qzeros"], self.bits, dim=1)[:, :n].T  # [N, G]
        scales = parts["scales"].T
        if zeros.shape != scales.shape:
            raise ValueError(f"qzeros hold {tuple(zeros.shape)} zeros for scales {scales.shape}")
        g_idx = parts.get("g_idx", contiguous_groups(k, self.group_size))
        if g_idx.shape != (k,) or int(g_idx.max()) >= scales.shape[1]:
            raise ValueError(f"g_idx does not give one of {scales.shape[1]} groups per input")
        return dequantize_groups(q, zeros + 1 if self.zeros_minus_one else zeros, scales, g_idx)
