"""The paged KV cache: the one object that owns the K/V tensors.

Layout per layer; a token's slot is block_id * block_size + offset_in_block:

| tensor          | shape                              | dtype                          |
|-----------------|------------------------------------|--------------------------------|
| key, value      | [num_blocks, block_size, Hkv, D]   | storage dtype (fp8 as uint8)   |
| key/value scale | [num_blocks, block_size, Hkv, 1]   | float32 (fp8_e4m3 only)        |

Reads gather whole blocks (one index_select of contiguous rows), twice as fast as gathering
token slots.

fp8_e4m3 stores each token's head vector divided by its own scale (amax / 448), so a token's
quantization error never depends on other tokens; attention dequantizes what it gathers.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn value

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
}


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # storage dtype

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block, scales included."""
        per_token = self.num_kv_heads * (self.head_dim * self.dtype.itemsize + 4 * self.quantized)
        return 2 * self.num_layers * self.block_size * per_token

    def num_blocks_for(self, memory_bytes: int) -> int:
        return max(memory_bytes // self.bytes_per_block, 1)


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


class PagedKVCache:
    """K/V storage for all layers. `write` stores new tokens into slots; `gather` returns the
    context of a batch of block tables in the compute dtype."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, compute_dtype: torch.dtype) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.compute_dtype = compute_dtype
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # fp8 is kept as raw bytes: CPU index kernels do not take float8 tensors.
        store = torch.uint8 if spec.quantized else spec.dtype
        self.key = [torch.zeros(shape, dtype=store) for _ in range(spec.num_layers)]
        self.value = [torch.zeros(shape, dtype=store) for _ in range(spec.num_layers)]
        scale_shape = (*shape[:3], 1) if spec.quantized else (0,)
        self.key_scale = [torch.ones(scale_shape) for _ in range(spec.num_layers)]
        self.value_scale = [torch.ones(scale_shape) for _ in range(spec.num_layers)]

    def write(
        self,
        layer: int,
        key: torch.Tensor,
        value: torch.Tensor,
        slots: torch.Tensor,
        kernels: ModuleType | None = None,
    ) -> None:
        """key/value: [T, Hkv, D] for the T tokens whose cache slots are `slots` [T]."""
        if kernels is not None and key.dtype == self.spec.dtype and key.stride(-1) == 1:
            kernels.write_kv(self.key[layer], self.value[layer], key, value, slots)
        elif self.spec.quantized:
            self._write_fp8(self.key[layer], self.key_scale[layer], key, slots)
            self._write_fp8(self.value[layer], self.value_scale[layer], value, slots)
        else:
            _slots(self.key[layer]).index_copy_(0, slots, key.to(self.spec.dtype, copy=False))
            _slots(self.value[layer]).index_copy_(0, slots, value.to(self.spec.dtype, copy=False))

    @staticmethod
    def _write_fp8(
        store: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, slots: torch.Tensor
    ) -> None:
        x = x.float()
        scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
        quantized = (x / scale).to(torch.float8_e4m3fn).view(torch.uint8)
        _slots(store).index_copy_(0, slots, quantized)
        _slots(scales).index_copy_(0, slots, scale)

    def kernel_readable(self, compute_dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the compiled decode-attention kernel reads this cache in place: fp8 bytes or
        the compute dtype itself, head_dim a multiple of 16 up to 256."""
        same = self.spec.quantized or self.spec.dtype == compute_dtype
        return same and head_dim % 16 == 0 and head_dim <= 256

    def layer_storage(self, layer: int) -> tuple[torch.Tensor, ...]:
        """(key, value, key_scale, value_scale) of a layer as stored (scales empty unless fp8)."""
        return self.key[layer], self.value[layer], self.key_scale[layer], self.value_scale[layer]

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks in `block_tables` [B, nb] as [B, nb * block_size, Hkv, D] in
        the compute dtype (token t of a sequence at index t)."""
        return (
            self._read(self.key[layer], self.key_scale[layer], block_tables),
            self._read(self.value[layer], self.value_scale[layer], block_tables),
        )

    def _read(
        self, store: torch.Tensor, scales: torch.Tensor, tables: torch.Tensor
    ) -> torch.Tensor:
        b, nb = tables.shape
        flat = tables.reshape(-1)
        x = store.index_select(0, flat).view(b, nb * self.spec.block_size, *store.shape[2:])
        if self.spec.quantized:
            s = scales.index_select(0, flat).view(b, nb * self.spec.block_size, *scales.shape[2:])
            return (x.view(torch.float8_e4m3fn).float() * s).to(self.compute_dtype)
        return x if x.dtype == self.compute_dtype else x.to(self.compute_dtype)


def _slots(blocks: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, ...] viewed as [num_slots, ...]."""
    return blocks.view(-1, *blocks.shape[2:])
