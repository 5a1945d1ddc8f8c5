"""What a model's KV cache holds, declared by the model: named components per token and layer
(Llama-family attention stores "key" and "value" of [Hkv, D]; an MLA model one "latent" of
[kv_lora_rank + rope_dim]; DeepSeek-V4 a window K=V row on every layer, compressor state on its
compressed layers and one entry per 4 or 128 tokens), and `KVRows`, one sequence's rows as a
cache stores them (thermostat.models.kv_cache holds the tensors).

A component has a `rate`: one row per `rate` tokens. The row of window w (tokens
[w * rate, (w + 1) * rate)) lives in the block of the window's last token, at row
`slot // min(rate, block_size)` of the flat rows (a block holds max(block_size // rate, 1)
rows), so a block of the prefix cache carries every row whose window ends in it.

A component may have a `window`: only its rows of the last `window` positions before a step's
first new token (and the step's own) are ever read. Components of one window share a block pool
of their own (the main pool, window None, holds the rest); every pool has the main pool's block
size and block hashes, a sequence's table per pool is aligned with its main table, and blocks
that fall out of the window are released (thermostat.engine.kv_blocks):

| pool           | holds                    | per sequence                          |
|----------------|--------------------------|---------------------------------------|
| 0 (main)       | components of no window  | grows: `bytes_per_token` per token    |
| 1.. (windowed) | rate-1 rows of a window  | fixed: `window_blocks(window)` blocks |"""

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
    window: int | None = None  # positions read behind a step's first new token; None: all

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
            if c.window is not None and (c.rate != 1 or c.window < 0):
                raise ValueError(f"{c.name}: a window needs rate 1, got {c.rate}, {c.window}")

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
    def pools(self) -> tuple[int | None, ...]:
        """The window of each block pool: None (the main pool) first, then each distinct
        window of a component, smallest first."""
        windows = {c.window for c in self.components if c.window is not None}
        return (None, *sorted(windows))

    def pool_of(self, name: str) -> int:
        """The index in `pools` of component `name`'s pool."""
        window = next(c.window for c in self.components if c.name == name)
        return self.pools.index(window)

    def pool_bytes_per_block(self, pool: int) -> int:
        """Every component of pool `pool`, every layer, for one block, scales included."""
        window = self.pools[pool]
        return sum(
            len(c.layer_ids(self.num_layers)) * c.rows_per_block(self.block_size) * c.bytes_per_row
            for c in self.components
            if c.window == window
        )

    def window_blocks(self, window: int) -> int:
        """Blocks a sequence holds between steps in a pool of `window`: ceil(window / bs) + 1."""
        return -(-window // self.block_size) + 1

    @property
    def bytes_per_block(self) -> int:
        """The main pool's components for one block (what grows with the context)."""
        return self.pool_bytes_per_block(0)

    @property
    def bytes_per_token(self) -> float:
        """What a token of context costs (a main block's bytes over its tokens)."""
        return self.bytes_per_block / self.block_size

    @property
    def fixed_bytes_per_sequence(self) -> int:
        """What a sequence holds in the window pools whatever its length."""
        return sum(
            self.window_blocks(w) * self.pool_bytes_per_block(p)
            for p, w in enumerate(self.pools)
            if w is not None
        )

    def num_blocks_for(self, memory_bytes: int) -> int:
        """Main-pool blocks of `memory_bytes`."""
        return max(memory_bytes // max(self.bytes_per_block, 1), 1)

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
                | ({} if c.window is None else {"window": c.window})
                for c in self.components
            ],
        }


@dataclass(frozen=True)
class KVRows:
    """Tokens [0, num_tokens) of one sequence in every layer, as a cache stores them.

    tensors: per component `name` -> [its layers, rows, *per_token_shape] in the storage
    dtype (fp8 as uint8), and for fp8 `name.scale` -> [its layers, rows, *shape[:-1], 1]
    float32; rows = num_tokens // rate (the windows complete within the tokens), or for a
    component with a window the last min(num_tokens, window) positions' rows."""

    num_tokens: int
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype
