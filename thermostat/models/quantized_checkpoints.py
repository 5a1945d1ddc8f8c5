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

Each format has its module (models.gptq, models.awq, models.compressed_tensors, sharing
models.packed_linears); models.int_packing has their packings. A layer quantized in activation
order (GPTQ desc_act, compressed-tensors actorder "group") mixes groups inside a block of 32: it
is dequantized exactly but served in int8 by default (each block requantized: within half an
int8 step of the checkpoint), since int4 would requantize it by range. `--quantization`
overrides the default either way. Tensors that are not a quantized layer's (embeddings, norms,
biases, modules left unquantized) pass through as stored.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from thermostat.models.awq import AWQ
from thermostat.models.compressed_tensors import CompressedTensors
from thermostat.models.fp8_weights import BlockFP8
from thermostat.models.gptq import GPTQ
from thermostat.models.packed_linears import Tensors

if TYPE_CHECKING:
    from transformers import PretrainedConfig


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
