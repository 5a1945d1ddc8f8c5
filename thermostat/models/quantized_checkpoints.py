"""Pre-quantized safetensors checkpoints, told apart by config.json `quantization_config`
`quant_method`: each linear layer's packed integers are read and dequantized to float32 under the
plain name (`X.weight`), which thermostat.models.weight_format then quantizes again into the
engine's int8 / int4 blocks. That second step is lossless: the float32 weight lies exactly on the
checkpoint's grid (integers times a float16 / bfloat16 scale) and `quant.grid_step` finds it
again, as long as each block of 32 inputs shares one scale and zero point.

| quant_method             | a linear layer X's tensors                   | served as (default)  |
|--------------------------|----------------------------------------------|----------------------|
| gptq, bits 4             | X.qweight, X.qzeros, X.scales, X.g_idx       | int4 (desc_act: int8) |
| gptq, bits 8             | the same                                     | int8                 |
| awq, version gemm        | X.qweight, X.qzeros, X.scales                | int4                 |
| compressed-tensors, int- | X.weight (int8), X.weight_scale, [X.weight_zero_point, _g_idx] |
| or naive-quantized       |                                              | int8 / int4 by bits  |
| compressed-tensors,      | X.weight_packed, X.weight_shape, X.weight_scale, [the same]         |
| pack-quantized           |                                              | int8 / int4 by bits  |
| fp8                      | thermostat.models.fp8_weights                | the dtype            |

thermostat.models.int_packing has the packings. A layer quantized in activation order (GPTQ
desc_act, compressed-tensors actorder "group") mixes groups inside a block of 32: it is
dequantized exactly but served in int8 by default (each block requantized: within half an int8
step of the checkpoint), since int4 would requantize it by range. `--quantization` overrides the
default either way. Tensors that are not a quantized layer's (embeddings, norms, biases, modules
left unquantized) pass through as stored.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from thermostat.models.fp8_weights import BlockFP8
from thermostat.models.int_packing import (
    awq_columns,
    contiguous_groups,
    dequantize_groups,
    unpack_int32,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

Tensors = Iterable[tuple[str, torch.Tensor]]


class WeightReader(Protocol):
    """What the loader asks of a checkpoint's quantization (BlockFP8 is one too)."""

    @property
    def serve_as(self) -> str | None:
        """The engine format served when the user names none: int8, int4, None (the dtype)."""

    @property
    def source(self) -> str:
        """What the checkpoint holds, for the startup log: 'gptq 4-bit g128'."""

    def read(self, tensors: Tensors) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors -> Hugging Face names and float tensors (quantized ones
        dequantized to float32). ValueError naming a tensor that cannot be read."""


def weight_reader(config: PretrainedConfig) -> WeightReader | None:
    """The reader of config.json's `quantization_config`, None when there is none; ValueError
    naming the field this loader cannot serve."""
    quant: Any = getattr(config, "quantization_config", None)
    if not quant:
        return None
    quant = dict(quant if isinstance(quant, dict) else quant.to_dict())
    method = quant.get("quant_method")
    if method == "fp8":
        return BlockFP8.from_config(config)
    if method == "gptq":
        return GPTQ.from_config(quant)
    if method == "awq":
        return AWQ.from_config(quant)
    if method == "compressed-tensors":
        return CompressedTensors.from_config(quant)
    raise ValueError(
        f"config.json: quantization_config.quant_method={method!r} is not supported (Thermostat "
        "loads fp8, gptq, awq and compressed-tensors checkpoints)"
    )


def refuse(field: str, value: object, served: str) -> ValueError:
    return ValueError(
        f"config.json: quantization_config.{field}={value!r} is not supported "
        f"(Thermostat loads {served})"
    )


def int4_or_int8(bits: int, group_size: int, act_order: bool) -> str:
    """int4 where every block of 32 inputs has one scale and zero point, else int8."""
    whole_blocks = group_size == -1 or group_size % 32 == 0
    return "int4" if bits == 4 and whole_blocks and not act_order else "int8"


def groups_name(group_size: int) -> str:
    return "per-channel" if group_size == -1 else f"g{group_size}"


class PackedLinears:
    """Collects each quantized layer's tensors (in any order, any shard) and yields its
    dequantized weight once all have come; a format names its parts and dequantizes."""

    def part(self, name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
        """(layer, part) for a quantized layer's tensor, None for any other tensor."""
        raise NotImplementedError

    def parts(self, layer: str) -> tuple[frozenset[str], frozenset[str]]:
        """(required, optional) parts of `layer`."""
        raise NotImplementedError

    def dequantize(self, layer: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """float32 [N, K]; ValueError naming what does not fit."""
        raise NotImplementedError

    def read(self, tensors: Tensors) -> Iterator[tuple[str, torch.Tensor]]:
        """ValueError naming a layer missing a part, or a checkpoint with no quantized layer
        (a float checkpoint under a quantization_config)."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        layers = 0
        for name, tensor in tensors:
            found = self.part(name, tensor)
            if found is None:
                yield name, tensor
                continue
            layer, part = found
            have = pending.setdefault(layer, {})
            have[part] = tensor
            required, optional = self.parts(layer)
            if have.keys() >= required | optional:
                layers += 1
                yield self._weight(layer, pending.pop(layer))
        for layer, have in pending.items():  # an optional part never came
            missing = self.parts(layer)[0] - have.keys()
            if missing:
                raise ValueError(f"checkpoint: {layer} has {sorted(have)} but no {sorted(missing)}")
            layers += 1
            yield self._weight(layer, have)
        if not layers:
            raise ValueError(
                f"checkpoint: no {type(self).__name__} layer in the weights, though config.json's "
                "quantization_config names that quantization"
            )

    def _weight(self, layer: str, parts: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
        try:
            return f"{layer}.weight", self.dequantize(layer, parts)
        except (ValueError, RuntimeError, IndexError) as exc:
            shapes = {p: tuple(t.shape) for p, t in parts.items()}
            raise ValueError(f"checkpoint: {layer} {shapes}: {exc}") from exc


def _split(name: str, suffixes: tuple[str, ...]) -> tuple[str, str] | None:
    layer, _, part = name.rpartition(".")
    return (layer, part) if layer and part in suffixes else None


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
        return _split(name, ("qweight", "qzeros", "scales", "g_idx"))

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
        return _split(name, ("qweight", "qzeros", "scales"))

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
        found = _split(
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
