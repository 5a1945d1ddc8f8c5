"""What a model's KV cache holds, declared by the model: named components per token and layer
(Llama-family attention stores "key" and "value" of [Hkv, D]; an MLA model one "latent" of
[kv_lora_rank + rope_dim]; DeepSeek-V4 a window K=V row on every layer, compressor state on its
compressed layers and one entry per 4 or 128 tokens), and `KVRows`, one sequence's rows as a
cache stores them (thermostat.models.kv_cache holds the tensors).

A component has a `rate`: one row per `rate` tokens. The row of window w (tokens
[w * rate, (w + 1) * rate)) lives in the block of the window's last token, at row
`slot // min(rate, block_size)` of the flat rows (a block holds max(block_size // rate, 1)
rows), so a block of the prefix cache carries every row whose window ends in it."""

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
    per_token_shape: tuple[int, ...]  # the shape of one row
    dtype: torch.dtype  # storage dtype; float8_e4m3fn adds a float32 scale per last-dim vector
    rate: int = 1  # tokens per row
    layers: tuple[int, ...] | None = None  # the layers that store it; None: every layer

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    @property
    def bytes_per_row(self) -> int:
        """One row of one layer, scales included."""
        elements = math.prod(self.per_token_shape)
        scales = elements // self.per_token_shape[-1] if self.quantized else 0
        return elements * self.dtype.itemsize + 4 * scales

    def rows_per_block(self, block_size: int) -> int:
        return max(block_size // self.rate, 1)

    def layer_ids(self, num_layers: int) -> tuple[int, ...]:
        return tuple(range(num_layers)) if self.layers is None else self.layers


@dataclass(frozen=True)
class KVCacheSpec:
    """One block: `block_size` tokens of every component, for each of its layers.
    Invariants: the components have distinct names; each rate divides the block size or is a
    multiple of it."""

    num_layers: int
    block_size: int
    components: tuple[CacheComponent, ...]

    def __post_init__(self) -> None:
        names = [c.name for c in self.components]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"cache components need distinct names, got {names}")
        bs = self.block_size
        for c in self.components:
            if bs % c.rate and c.rate % bs:
                raise ValueError(f"{c.name}: rate {c.rate} does not fit blocks of {bs}")

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
        """The storage dtype of the first component (the attention's keys or rows)."""
        return self.components[0].dtype

    @property
    def quantized(self) -> bool:
        """Some component is stored in fp8."""
        return any(c.quantized for c in self.components)

    @property
    def is_key_value(self) -> bool:
        """Exactly "key" and "value" of one [heads, head_dim] shape: what the compiled write and
        decode attention take."""
        shapes = {c.name: c.per_token_shape for c in self.components}
        return (
            set(shapes) == {"key", "value"}
            and shapes["key"] == shapes["value"]
            and len(shapes["key"]) == 2
            and all(c.rate == 1 and c.layers is None for c in self.components)
            and len({c.dtype for c in self.components}) == 1
        )

    @property
    def bytes_per_block(self) -> int:
        """Every component of every layer for one block, scales included."""
        return sum(
            len(c.layer_ids(self.num_layers)) * c.rows_per_block(self.block_size) * c.bytes_per_row
            for c in self.components
        )

    @property
    def bytes_per_token(self) -> float:
        """What a token of context costs (a block's bytes over its tokens)."""
        return self.bytes_per_block / self.block_size

    def num_blocks_for(self, memory_bytes: int) -> int:
        return max(memory_bytes // self.bytes_per_block, 1)

    def describe(self) -> dict[str, object]:
        """What a token's rows are, independent of the block size: two caches whose
        descriptions are equal can exchange rows (`PagedKVCache.export` / `load`)."""
        return {
            "num_layers": self.num_layers,
            "components": [
                {
                    "name": c.name,
                    "shape": list(c.per_token_shape),
                    "dtype": str(c.dtype),
                    "rate": c.rate,
                    "layers": list(c.layer_ids(self.num_layers)),
                }
                for c in self.components
            ],
        }


@dataclass(frozen=True)
class KVRows:
    """Tokens [0, num_tokens) of one sequence in every layer, as a cache stores them.

    tensors: per component `name` -> [its layers, rows, *per_token_shape] in the storage
    dtype (fp8 as uint8), and for fp8 `name.scale` -> [its layers, rows, *shape[:-1], 1]
    float32; rows = num_tokens // rate (the windows complete within the tokens)."""

    num_tokens: int
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype
