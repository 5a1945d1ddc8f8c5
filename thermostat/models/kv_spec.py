"""What a model's KV cache holds, declared by the model: named components per token and layer
(Llama-family attention stores "key" and "value" of [Hkv, D]; an MLA model one "latent" of
[kv_lora_rank + rope_dim]), and `KVRows`, one sequence's rows as a cache stores them
(thermostat.models.kv_cache holds the tensors)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
}


@dataclass(frozen=True)
class CacheComponent:
    """What a layer stores per token under one name: a [*per_token_shape] tensor."""

    name: str
    per_token_shape: tuple[int, ...]
    dtype: torch.dtype  # storage dtype; float8_e4m3fn adds a float32 scale per last-dim vector

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    @property
    def bytes_per_token(self) -> int:
        """One token of one layer, scales included."""
        elements = math.prod(self.per_token_shape)
        scales = elements // self.per_token_shape[-1] if self.quantized else 0
        return elements * self.dtype.itemsize + 4 * scales


@dataclass(frozen=True)
class KVCacheSpec:
    """One block: `block_size` tokens of every component, for each of `num_layers` layers.
    Invariant: the components have distinct names and one storage dtype."""

    num_layers: int
    block_size: int
    components: tuple[CacheComponent, ...]

    def __post_init__(self) -> None:
        names = [c.name for c in self.components]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"cache components need distinct names, got {names}")
        if len({c.dtype for c in self.components}) != 1:
            raise ValueError("cache components must share one storage dtype")

    @classmethod
    def key_value(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
    ) -> KVCacheSpec:
        """A key and a value of [num_kv_heads, head_dim] per token (multi-head and grouped-query
        attention)."""
        shape = (num_kv_heads, head_dim)
        return cls(
            num_layers,
            block_size,
            (CacheComponent("key", shape, dtype), CacheComponent("value", shape, dtype)),
        )

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype of every component."""
        return self.components[0].dtype

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    @property
    def is_key_value(self) -> bool:
        """Exactly "key" and "value" of one [heads, head_dim] shape: what the compiled write and
        decode attention take."""
        shapes = {c.name: c.per_token_shape for c in self.components}
        return (
            set(shapes) == {"key", "value"}
            and shapes["key"] == shapes["value"]
            and len(shapes["key"]) == 2
        )

    @property
    def bytes_per_block(self) -> int:
        """Every component of every layer for one block, scales included."""
        per_token = sum(c.bytes_per_token for c in self.components)
        return self.num_layers * self.block_size * per_token

    def num_blocks_for(self, memory_bytes: int) -> int:
        return max(memory_bytes // self.bytes_per_block, 1)

    def describe(self) -> dict[str, object]:
        """What a token's rows are, independent of the block size: two caches whose
        descriptions are equal can exchange rows (`PagedKVCache.export` / `load`)."""
        return {
            "num_layers": self.num_layers,
            "components": [
                {"name": c.name, "shape": list(c.per_token_shape), "dtype": str(c.dtype)}
                for c in self.components
            ],
        }


@dataclass(frozen=True)
class KVRows:
    """Tokens [0, num_tokens) of one sequence in every layer, as a cache stores them.

    tensors: per component `name` -> [num_layers, num_tokens, *per_token_shape] in the storage
    dtype (fp8 as uint8), and for fp8 `name.scale` -> [num_layers, num_tokens, *shape[:-1], 1]
    float32."""

    num_tokens: int
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype
