"""compressed-tensors checkpoints with integer weights (llm-compressor's W8A8 int8 and W4A16, as
vLLM and SGLang serve them; config.json quantization_config quant_method compressed-tensors).

| format                          | a linear layer X's tensors                                   |
|---------------------------------|--------------------------------------------------------------|
| int-quantized, naive-quantized  | X.weight int8 (signed q), X.weight_scale                     |
| pack-quantized                  | X.weight_packed int32, X.weight_shape [N, K], X.weight_scale |
| both, asymmetric                | X.weight_zero_point (pack-quantized: packed along N)         |
| both, actorder "group"          | X.weight_g_idx                                               |

weight_scale is [N, 1] (strategy channel), [N, K / group_size] (group) or one value (tensor);
w = (q - z) * s. Each config group's `targets` (layer names, "re:" patterns, "Linear") says
which layers its weights settings describe. Activation settings are accepted when dynamic (the
engine quantizes activations per block of 32 anyway); static ones, output activations, a KV
cache scheme, sparsity and transforms are refused by field. Served in int8 (8-bit) or int4."""

from __future__ import annotations

import re
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

CT_FORMATS = ("int-quantized", "naive-quantized", "pack-quantized")


@dataclass(frozen=True)
class IntScheme:
    """One compressed-tensors config group's integer weights."""

    targets: tuple[str, ...]  # layer names, "re:" patterns, or the class "Linear"
    bits: int
    strategy: str  # channel | group | tensor
    group_size: int  # -1 unless strategy group
    symmetric: bool  # no zero point stored
    act_order: bool  # actorder "group": weight_g_idx scatters the groups
    packed: bool  # pack-quantized: weight_packed int32; else weight int8

    @classmethod
    def from_config(cls, name: str, group: dict[str, Any], top_format: str | None) -> IntScheme:
        field = f"config_groups.{name}"
        w = group.get("weights")
        if not isinstance(w, dict):
            raise refuse(f"{field}.weights", w, "quantized integer weights")
        if w.get("type", "int") != "int":
            raise refuse(f"{field}.weights.type", w.get("type"), "'int' weights")
        bits, group_size = w.get("num_bits", 8), w.get("group_size")
        if bits not in (4, 8):
            raise refuse(f"{field}.weights.num_bits", bits, "4 or 8")
        strategy = w.get("strategy") or (
            "tensor" if group_size is None else "channel" if group_size == -1 else "group"
        )
        if strategy not in ("channel", "group", "tensor"):
            raise refuse(f"{field}.weights.strategy", strategy, "'channel', 'group', 'tensor'")
        if strategy != "group":
            group_size = -1
        elif not (isinstance(group_size, int) and group_size > 0):
            raise refuse(f"{field}.weights.group_size", group_size, "a positive group size")
        if w.get("dynamic"):
            raise refuse(f"{field}.weights.dynamic", w["dynamic"], "static weights (false)")
        actorder = w.get("actorder")
        if actorder not in (None, False, True, "group", "dynamic", "weight", "static"):
            raise refuse(f"{field}.weights.actorder", actorder, "'group', 'weight' or null")
        inputs = group.get("input_activations")
        if inputs is not None and inputs.get("dynamic") is not True:
            raise refuse(
                f"{field}.input_activations.dynamic",
                inputs.get("dynamic"),
                "dynamic activation quantization (the engine quantizes activations per block)",
            )
        if group.get("output_activations") is not None:
            raise refuse(f"{field}.output_activations", group["output_activations"], "null")
        fmt = group.get("format") or top_format
        if fmt not in CT_FORMATS:
            where = f"{field}.format" if group.get("format") else "format"
            raise refuse(where, fmt, " / ".join(CT_FORMATS))
        return cls(
            targets=tuple(group.get("targets") or ("Linear",)),
            bits=bits,
            strategy=strategy,
            group_size=group_size,
            symmetric=w.get("symmetric", True) is not False,
            act_order=actorder in (True, "group", "dynamic"),
            packed=fmt == "pack-quantized",
        )

    def matches(self, layer: str, how: str) -> bool:
        for target in self.targets:
            if how == "name" and target == layer:
                return True
            if how == "regex" and target.startswith("re:") and re.match(target[3:], layer):
                return True
            if how == "class" and target == "Linear":
                return True
        return False


@dataclass(frozen=True)
class CompressedTensors(PackedLinears):
    """llm-compressor / compressed-tensors checkpoints with integer weights (W8A8 int8, W4A16),
    as vLLM and SGLang serve them."""

    schemes: tuple[IntScheme, ...]

    @classmethod
    def from_config(cls, quant: dict[str, Any]) -> CompressedTensors:
        for field, served in (("kv_cache_scheme", "null"), ("transform_config", "null")):
            if quant.get(field):
                raise refuse(field, quant[field], served)
        sparsity = quant.get("sparsity_config")
        if sparsity and sparsity.get("format", "dense") != "dense":
            raise refuse("sparsity_config.format", sparsity.get("format"), "dense weights")
        status = quant.get("quantization_status")
        if status not in (None, "compressed"):
            raise refuse("quantization_status", status, "'compressed' checkpoints")
        groups = quant.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise refuse("config_groups", groups, "one or more config groups")
        schemes = tuple(
            IntScheme.from_config(name, group, quant.get("format"))
            for name, group in groups.items()
        )
        return cls(schemes)

    @property
    def serve_as(self) -> str:
        formats = {int4_or_int8(s.bits, s.group_size, s.act_order) for s in self.schemes}
        return "int4" if formats == {"int4"} else "int8"

    @property
    def source(self) -> str:
        names = dict.fromkeys(f"int{s.bits} {groups_name(s.group_size)}" for s in self.schemes)
        return f"compressed-tensors {', '.join(names)}"

    def scheme(self, layer: str) -> IntScheme:
        for how in ("name", "regex", "class"):
            for scheme in self.schemes:
                if scheme.matches(layer, how):
                    return scheme
        raise ValueError(f"checkpoint: {layer} is quantized but no config_groups target names it")

    def part(self, name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
        found = layer_part(
            name,
            ("weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point")
            + ("weight_g_idx",),
        )
        if found is not None and found[1] == "weight" and tensor.dtype != torch.int8:
            return None  # a layer left in float (`ignore`)
        return found

    def parts(self, layer: str) -> tuple[frozenset[str], frozenset[str]]:
        s = self.scheme(layer)
        need = {"weight_packed", "weight_shape"} if s.packed else {"weight"}
        need |= {"weight_scale"} | (set() if s.symmetric else {"weight_zero_point"})
        return frozenset(need | ({"weight_g_idx"} if s.act_order else set())), frozenset()

    def dequantize(self, layer: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        s = self.scheme(layer)
        offset = 1 << (s.bits - 1)  # pack-quantized stores q + offset, z + offset
        if s.packed:
            n, k = (int(v) for v in parts["weight_shape"].tolist())
            q = unpack_int32(parts["weight_packed"], s.bits, dim=1)[:, :k] - offset
        else:
            q = parts["weight"]
            n, k = q.shape
        groups = 1 if s.group_size == -1 else -(-k // s.group_size)
        scale = parts["weight_scale"]
        if scale.numel() not in (1, n * groups):
            raise ValueError(f"weight_scale is not {n} x {groups} scales")
        scales = scale.reshape(1, 1).expand(n, 1) if scale.numel() == 1 else scale.view(n, groups)
        zeros = parts.get("weight_zero_point")
        if zeros is not None:
            if s.packed and s.strategy != "tensor":
                zeros = unpack_int32(zeros, s.bits, dim=0)[:n] - offset
            zeros = zeros.reshape(1, 1).expand(n, 1) if zeros.numel() == 1 else zeros
            zeros = zeros.reshape(scales.shape)
        g_idx = parts.get("weight_g_idx", contiguous_groups(k, s.group_size))
        return dequantize_groups(q, zeros, scales, g_idx)
