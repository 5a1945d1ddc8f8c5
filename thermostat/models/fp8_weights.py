"""Block-fp8 checkpoints, as DeepSeek ships V3/R1 and V4 (and Qwen ships its -FP8 models):
config.json `quantization_config` {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [128, 128]}, plus for V4 `"scale_fmt": "ue8m0"` and
`expert_dtype` (in quantization_config or top level), dequantized once at load to the serving dtype.

| tensor             | dtype                                   | shape                          |
|--------------------|-----------------------------------------|--------------------------------|
| X.weight           | float8_e4m3fn                           | [..., out, in]                 |
| X.weight_scale_inv | float32 (V3, Qwen)                      | [..., ceil(out/bo), ceil(in/bi)] |
| X.scale            | float8_e8m0fnu (V4), float32 (V4-Base)  | the same                       |
| X.weight (fp4)     | int8 / uint8 / float4_e2m1fn_x2         | [..., out, in/2]               |
| X.scale (fp4)      | float8_e8m0fnu                          | [..., out, in/32]              |

(bo, bi) = `weight_block_size` (null: one scale per tensor). The weight is
`X.weight.float() * scale` broadcast over each block; the last row and column of blocks may be
partial. An e8m0 scale byte b is 2**(b - 127) exactly (`scale_fmt: "ue8m0"`; uint8 scales are read
as those bytes too). `expert_dtype: "fp4"` (V4-Flash's routed experts) packs two e2m1 values per
byte with one e8m0 scale per 32 inputs: thermostat.models.mxfp4 has the layout. A scale is
`X.weight_scale_inv` or `X.scale`; a `.scale` tensor of one dimension with no quantized `X.weight`
before it is an ordinary parameter (transformers' `attn_hc.scale`) and passes through. Tensors
without a scale (embeddings, norms, the router, lm_head, biases, V4's bf16 compressors) are read
as the checkpoint stores them.

What it costs: the model is held in the serving dtype, so memory is that dtype's size (bfloat16
doubles the fp8 file, float32 quadruples it; fp4 experts grow 4x / 8x), and it runs exactly as a
checkpoint saved in that dtype would: same speed, nothing is computed in fp8. Only the load does
one multiply per weight. The activation scheme is moot for the same reason, but "static"
checkpoints carry activation scales this loader does not read, so they are refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from thermostat.models.mxfp4 import PACKED_DTYPES, dequantize_mxfp4, e8m0_to_float32

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv"
V4_SCALE_SUFFIX = ".scale"  # DeepSeek-V4: "X.weight" -> "X.scale"

# quantization_config fields this loader reads: the values it can serve (None: field absent)
_SERVED: dict[str, tuple[object, ...]] = {
    "fmt": (None, "e4m3"),
    "activation_scheme": (None, "dynamic"),
    "scale_fmt": (None, "float", "ue8m0"),
    "expert_dtype": (None, "fp8", "fp4"),
}


@dataclass(frozen=True)
class BlockFP8:
    """A checkpoint's fp8 weight layout; `read` turns its tensors into dequantized ones."""

    block: tuple[int, int] | None  # (b_out, b_in); None: one scale per tensor
    ue8m0: bool = False  # scale_fmt ue8m0: uint8 scales are e8m0 bytes
    fp4_experts: bool = False  # expert_dtype fp4: packed MXFP4 weights may appear

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> BlockFP8 | None:
        """None for an unquantized checkpoint; ValueError naming the quantization_config field
        that this loader cannot serve."""
        quant: Any = getattr(config, "quantization_config", None)
        if not quant:
            return None
        if not isinstance(quant, dict):
            quant = quant.to_dict()
        quant = dict(quant)
        if quant.get("expert_dtype") is None and getattr(config, "expert_dtype", None):
            quant["expert_dtype"] = config.expert_dtype  # V4's legacy top-level key
        method = quant.get("quant_method")
        if method != "fp8":
            raise ValueError(
                f"config.json: quantization_config.quant_method={method!r} is not supported "
                "(Thermostat loads block-fp8 weights, quant_method 'fp8')"
            )
        for field, served in _SERVED.items():
            if quant.get(field) not in served:
                raise ValueError(
                    f"config.json: quantization_config.{field}={quant[field]!r} is not supported "
                    f"(Thermostat loads {' or '.join(repr(v) for v in served if v)})"
                )
        flags = {
            "ue8m0": quant.get("scale_fmt") == "ue8m0",
            "fp4_experts": quant.get("expert_dtype") == "fp4",
        }
        block = quant.get("weight_block_size")
        if block is None:
            return cls(None, **flags)
        if not (
            isinstance(block, list | tuple)
            and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise ValueError(
                f"config.json: quantization_config.weight_block_size={block!r} is not two "
                "positive integers"
            )
        return cls((block[0], block[1]), **flags)

    @property
    def serve_as(self) -> None:
        """Served in the dtype unless `--quantization` says otherwise (fp8 is no engine format)."""
        return None

    @property
    def source(self) -> str:
        blocks = "per tensor" if self.block is None else f"blocks {self.block[0]}x{self.block[1]}"
        return f"fp8 e4m3 {blocks}" + (", fp4 experts" if self.fp4_experts else "")

    def read(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors -> the same names, each quantized weight dequantized to float32
        once its scale has been read (in either order, any shard); scales are consumed.
        ValueError naming a quantized weight without its scale or a scale without its weight."""
        weights: dict[str, torch.Tensor] = {}  # quantized weights waiting for their scale
        scales: dict[str, tuple[str, torch.Tensor]] = {}  # by weight name: (scale name, scale)
        for name, tensor in tensors:
            weight_name = self._scale_of(name, tensor, weights)
            if weight_name is not None:
                if weight_name in weights:
                    weight = weights.pop(weight_name)
                    yield weight_name, self.dequantize(weight_name, weight, tensor, name)
                else:
                    scales[weight_name] = (name, tensor)
            elif self._is_quantized(name, tensor):
                if name in scales:
                    scale_name, scale = scales.pop(name)
                    yield name, self.dequantize(name, tensor, scale, scale_name)
                else:
                    weights[name] = tensor
            else:
                yield name, tensor
        if weights:
            raise ValueError(
                f"checkpoint: quantized {sorted(weights)[:5]} without {SCALE_SUFFIX} "
                f"or {V4_SCALE_SUFFIX}"
            )
        if scales:
            orphans = sorted(scale_name for scale_name, _ in scales.values())[:5]
            raise ValueError(f"checkpoint: {orphans} without a float8 weight")

    def _scale_of(
        self, name: str, tensor: torch.Tensor, pending: dict[str, torch.Tensor]
    ) -> str | None:
        """The weight name `name` is the scale of, or None when it is no scale."""
        if name.endswith(SCALE_SUFFIX):
            return name.removesuffix(SCALE_SUFFIX)
        if not name.endswith(V4_SCALE_SUFFIX):
            return None
        weight_name = name.removesuffix(V4_SCALE_SUFFIX) + ".weight"
        if weight_name in pending or tensor.dtype == torch.float8_e8m0fnu or tensor.dim() >= 2:
            return weight_name
        return None  # a one-dimensional parameter named `scale` (transformers' attn_hc.scale)

    def _is_quantized(self, name: str, tensor: torch.Tensor) -> bool:
        if tensor.is_floating_point() and tensor.element_size() == 1:
            return True  # float8 of any kind (dequantize names the unsupported ones)
        if tensor.dtype == torch.float4_e2m1fn_x2:
            return True
        return self.fp4_experts and tensor.dtype in PACKED_DTYPES and name.endswith(".weight")

    def dequantize(
        self,
        name: str,
        weight: torch.Tensor,
        scale_inv: torch.Tensor,
        scale_name: str | None = None,
    ) -> torch.Tensor:
        """float8_e4m3fn [..., out, in] and its block scales, or (expert_dtype fp4) packed
        MXFP4 [..., out, in/2] and its e8m0 scales -> float32 [..., out, in]."""
        scale_name = scale_name or name + SCALE_SUFFIX
        if weight.dtype in PACKED_DTYPES:
            if not self.fp4_experts:
                raise ValueError(
                    f"checkpoint: {name} is {weight.dtype} (packed fp4), but quantization_config "
                    "has no expert_dtype 'fp4'"
                )
            if scale_inv.dtype not in (torch.float8_e8m0fnu, torch.uint8):
                raise ValueError(
                    f"checkpoint: {scale_name} is {scale_inv.dtype}, an MXFP4 weight's scales "
                    "are float8_e8m0fnu"
                )
            try:
                return dequantize_mxfp4(weight, scale_inv)
            except ValueError as exc:
                raise ValueError(f"checkpoint: {name}: {exc}") from exc
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(
                f"checkpoint: {name} is {weight.dtype}, quantization_config fmt e4m3 means "
                "torch.float8_e4m3fn"
            )
        scale = self.scale_float32(scale_inv)
        if self.block is None:
            expected: tuple[int, ...] = (1,)
            if scale.numel() != 1:
                raise _scale_shape_error(name, scale_name, scale_inv, expected, weight)
            return weight.float() * scale.reshape(())
        (b_out, b_in), (rows, cols) = self.block, weight.shape[-2:]
        expected = (*weight.shape[:-2], -(-rows // b_out), -(-cols // b_in))
        if tuple(scale.shape) != expected:
            raise _scale_shape_error(name, scale_name, scale_inv, expected, weight, self.block)
        scale = scale.repeat_interleave(b_out, -2).repeat_interleave(b_in, -1)
        return weight.float() * scale[..., :rows, :cols]  # the edge blocks may be partial

    def scale_float32(self, scale: torch.Tensor) -> torch.Tensor:
        """A block scale as float32: e8m0 bytes (float8_e8m0fnu, or uint8 under scale_fmt
        ue8m0) exactly as 2**(b - 127), any float as it is."""
        if scale.dtype == torch.float8_e8m0fnu or (self.ue8m0 and scale.dtype == torch.uint8):
            return e8m0_to_float32(scale)
        return scale.float()


def _scale_shape_error(
    name: str,
    scale_name: str,
    scale_inv: torch.Tensor,
    expected: tuple[int, ...],
    weight: torch.Tensor,
    block: tuple[int, int] | None = None,
) -> ValueError:
    blocks = f"blocks of {list(block)}" if block else "one scale per tensor"
    return ValueError(
        f"checkpoint: {scale_name} has shape {tuple(scale_inv.shape)}, expected "
        f"{expected} for {name} {tuple(weight.shape)} in {blocks}"
    )
