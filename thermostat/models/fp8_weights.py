"""Block-fp8 checkpoints, as DeepSeek ships V3/R1 (and Qwen ships its -FP8 models): config.json
`quantization_config` {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}, dequantized once at load to the serving dtype.

| tensor               | dtype          | shape                                             |
|----------------------|----------------|---------------------------------------------------|
| X.weight             | float8_e4m3fn  | [..., out, in]                                    |
| X.weight_scale_inv   | float32        | [..., ceil(out / b_out), ceil(in / b_in)]          |

(b_out, b_in) = `weight_block_size` (null: one scale per tensor). The weight is
`X.weight.float() * X.weight_scale_inv` broadcast over each block; the last row and column of
blocks may be partial. Tensors without a scale (embeddings, norms, the router, lm_head, biases)
are read as the checkpoint stores them.

What it costs: the model is held in the serving dtype, so memory is that dtype's size (bfloat16
doubles the fp8 file, float32 quadruples it), and it runs exactly as a checkpoint saved in that
dtype would: same speed, nothing is computed in fp8. Only the load does one multiply per weight.
The activation scheme is moot for the same reason, but "static" checkpoints carry activation
scales this loader does not read, so they are refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv"

# quantization_config fields this loader reads: the values it can serve (None: field absent)
_SERVED: dict[str, tuple[object, ...]] = {
    "fmt": (None, "e4m3"),
    "activation_scheme": (None, "dynamic"),
    "scale_fmt": (None, "float"),
    "expert_dtype": (None, "fp8"),
}


@dataclass(frozen=True)
class BlockFP8:
    """A checkpoint's fp8 weight layout; `read` turns its tensors into dequantized ones."""

    block: tuple[int, int] | None  # (b_out, b_in); None: one scale per tensor

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> BlockFP8 | None:
        """None for an unquantized checkpoint; ValueError naming the quantization_config field
        that this loader cannot serve."""
        quant: Any = getattr(config, "quantization_config", None)
        if not quant:
            return None
        if not isinstance(quant, dict):
            quant = quant.to_dict()
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
        block = quant.get("weight_block_size")
        if block is None:
            return cls(None)
        if not (
            isinstance(block, list | tuple)
            and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise ValueError(
                f"config.json: quantization_config.weight_block_size={block!r} is not two "
                "positive integers"
            )
        return cls((block[0], block[1]))

    def read(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors -> the same names, each float8 weight dequantized to float32 once its
        scale has been read (in either order, any shard); scales are consumed. ValueError naming
        a float8 weight without its scale or a scale without its float8 weight."""
        weights: dict[str, torch.Tensor] = {}  # float8 weights waiting for their scale
        scales: dict[str, torch.Tensor] = {}  # scales waiting for their weight, by weight name
        for name, tensor in tensors:
            if name.endswith(SCALE_SUFFIX):
                weight_name = name.removesuffix(SCALE_SUFFIX)
                if weight_name in weights:
                    yield (
                        weight_name,
                        self.dequantize(weight_name, weights.pop(weight_name), tensor),
                    )
                else:
                    scales[weight_name] = tensor
            elif tensor.is_floating_point() and tensor.element_size() == 1:
                if name in scales:
                    yield name, self.dequantize(name, tensor, scales.pop(name))
                else:
                    weights[name] = tensor
            else:
                yield name, tensor
        if weights:
            raise ValueError(f"checkpoint: float8 {sorted(weights)[:5]} without {SCALE_SUFFIX}")
        if scales:
            orphans = sorted(n + SCALE_SUFFIX for n in scales)[:5]
            raise ValueError(f"checkpoint: {orphans} without a float8 weight")

    def dequantize(self, name: str, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """float8_e4m3fn [..., out, in] and its scales -> float32 [..., out, in]."""
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(
                f"checkpoint: {name} is {weight.dtype}, quantization_config fmt e4m3 means "
                "torch.float8_e4m3fn"
            )
        scale = scale_inv.float()
        if self.block is None:
            expected: tuple[int, ...] = (1,)
            if scale.numel() != 1:
                raise _scale_shape_error(name, scale_inv, expected, weight)
            return weight.float() * scale.reshape(())
        (b_out, b_in), (rows, cols) = self.block, weight.shape[-2:]
        expected = (*weight.shape[:-2], -(-rows // b_out), -(-cols // b_in))
        if tuple(scale.shape) != expected:
            raise _scale_shape_error(name, scale_inv, expected, weight, self.block)
        scale = scale.repeat_interleave(b_out, -2).repeat_interleave(b_in, -1)
        return weight.float() * scale[..., :rows, :cols]  # the edge blocks may be partial


def _scale_shape_error(
    name: str,
    scale_inv: torch.Tensor,
    expected: tuple[int, ...],
    weight: torch.Tensor,
    block: tuple[int, int] | None = None,
) -> ValueError:
    blocks = f"blocks of {list(block)}" if block else "one scale per tensor"
    return ValueError(
        f"checkpoint: {name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}, expected "
        f"{expected} for {name} {tuple(weight.shape)} in {blocks}"
    )
