"""The paged KV cache: the one object that owns the cache tensors of every layer, laid out as its
`KVCacheSpec` (thermostat.models.kv_spec) declares. A token's slot is block_id * block_size +
offset_in_block; per layer and component: store[name][layer] [num_blocks, rows, *per_token_shape]
(storage dtype; fp8 as uint8) and scales[name][layer] [num_blocks, rows, *per_token_shape[:-1], 1]
(float32, fp8_e4m3 only, else empty [0]). rows = block_size for a component of rate 1, else its
rows per block (kv_spec); a component has tensors only for its layers, and num_blocks of its pool
(`spec.pools`: the main pool, then one per component window; their slots and rows are the pool's
own block ids times rows). `put` and `take` write and read a component's flat rows
(block_id * rows + row) directly. Reads gather whole blocks (one index_select of contiguous rows,
twice as fast as gathering token slots).

fp8_e4m3 stores each vector (the last dim) divided by its own scale (amax / 448), so a token's
quantization error never depends on other tokens; reads dequantize what they gather. How the
cache is written and how decode attention reads a key/value layout depend on how it is stored,
so both paths are chosen once here, when the cache is built (see thermostat.kernels).

`export` and `load` move one sequence's rows between caches of one spec (prefill/decode
disaggregation) as stored: fp8 rows travel as their bytes with their scales, so the copy is
bit-exact whatever the block sizes of the two caches. They take the slots per pool: every
position's in the main pool, the last `window` positions' in a window pool.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from thermostat.kernels import CpuOps
from thermostat.models.kv_spec import KVCacheSpec, KVRows

if TYPE_CHECKING:
    from thermostat.models.attention import AttentionMetadata, PrefillSegment

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def zeros_as_written(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros over a fresh private anonymous mapping: the system's zero pages, each committed
    when first written, so a cache is made at once and its resident memory grows as it fills
    (torch.zeros writes every byte first: the default 1 GB cache took 0.45 s of each start)."""
    size = math.prod(shape) * dtype.itemsize
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # the tensor keeps it alive
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)


class PagedKVCache:
    """Cache storage for all layers. `write` stores new tokens into slots; `gather` returns the
    context of a batch of block tables in the compute dtype; `decode_attention` attends one query
    token per sequence over a key/value layout.

    `ops`: the compiled kernels, used for the paths they take on this layout (else PyTorch)."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int | Sequence[int],
        compute_dtype: torch.dtype,
        ops: CpuOps | None = None,
    ) -> None:
        """num_blocks: per pool of `spec.pools` (one number: the same for every pool)."""
        self.spec = spec
        pools = len(spec.pools)
        sizes = [num_blocks] * pools if isinstance(num_blocks, int) else list(num_blocks)
        if len(sizes) != pools:
            raise ValueError(f"{len(sizes)} block counts for {pools} pools")
        self.pool_blocks = tuple(sizes)
        self.num_blocks = sizes[0]
        self.compute_dtype = compute_dtype
        self.store: dict[str, dict[int, torch.Tensor]] = {}
        self.scales: dict[str, dict[int, torch.Tensor]] = {}
        self._components = {c.name: c for c in spec.components}
        for c in spec.components:
            shape = (
                sizes[spec.pool_of(c.name)],
                c.rows_per_block(spec.block_size),
                *c.per_token_shape,
            )
            # fp8 is kept as raw bytes: CPU index kernels do not take float8 tensors.
            storage = torch.uint8 if c.quantized else c.dtype
            scale_shape = (*shape[:-1], 1) if c.quantized else (0,)
            layers = c.layer_ids(spec.num_layers)
            self.store[c.name] = {i: zeros_as_written(shape, storage) for i in layers}
            self.scales[c.name] = {i: torch.ones(scale_shape) for i in layers}

        # The one choice of each path (the table in thermostat.kernels).
        self.ops = ops if spec.is_key_value else None
        head_dim = spec.components[0].per_token_shape[-1]
        in_place = spec.quantized or spec.dtype == compute_dtype
        self._write = (
            self._write_compiled if self.ops is not None and in_place else self._write_torch
        )
        self._decode = (
            self._decode_compiled
            if self.ops is not None and in_place and head_dim % 16 == 0 and head_dim <= 256
            else self._decode_sdpa
        )
        self._prefills_in_place = (
            self.ops is not None
            and self.ops.has_prefill_attention
            and compute_dtype == torch.bfloat16
            and (spec.dtype == compute_dtype or spec.quantized)  # bf16 or fp8 blocks
            and head_dim % 32 == 0
            and head_dim <= 256
        )

    @property
    def in_place_kernels(self) -> bool:
        """Whether new tokens are written, and decodes attend, in the compiled kernels (what the
        compiled decode step, thermostat.models.compiled_decode, needs)."""
        return self._write == self._write_compiled and self._decode == self._decode_compiled

    def write(self, layer: int, values: tuple[torch.Tensor, ...], slots: torch.Tensor) -> None:
        """values: one [T, *per_token_shape] tensor per component, in spec order (with the last
        dim contiguous), for the T tokens whose cache slots are `slots` [T] int64."""
        self._write(layer, values, slots)

    def decode_attention(
        self, q: torch.Tensor, layer: int, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Key/value layout only. q [nd, Hq, D]: one token per decoding sequence, attending to
        its blocks (meta.decode_*). Returns [nd, Hq, D]."""
        return self._decode(q, layer, meta, scale)

    def attends_prefills(self, q_heads: int) -> bool:
        """Whether `prefill_attention` runs here for a layer of `q_heads` query heads: the
        compiled kernel reads bf16 or fp8 blocks in place (else prefill chunks go to SDPA)."""
        kv_heads = self.spec.components[0].per_token_shape[-2]
        return self._prefills_in_place and q_heads <= PREFILL_GROUP_MAX * kv_heads

    def prefill_attention(
        self, q: torch.Tensor, layer: int, segment: PrefillSegment, scale: float
    ) -> torch.Tensor:
        """Key/value layout, where `attends_prefills`. q [q_len, Hq, D]: a chunk of one
        sequence's new tokens (already written), causal over its context (no sliding window).
        Returns [q_len, Hq, D], the same bits whole or chunked."""
        assert self.ops is not None  # attends_prefills holds only with ops
        key, value, key_scale, value_scale = self.layer_storage(layer)
        return self.ops.prefill_attention(
            q,
            key,
            value,
            key_scale,
            value_scale,
            segment.block_table[0],
            segment.ctx_len - segment.q_len,
            scale,
        )

    def layer_storage(self, layer: int) -> tuple[torch.Tensor, ...]:
        """A layer's tensors as stored, then their scales, in spec order (for key/value:
        key, value, key_scale, value_scale; scales empty unless fp8)."""
        names = [c.name for c in self.spec.components]
        return (*(self.store[n][layer] for n in names), *(self.scales[n][layer] for n in names))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each component (spec order) of the blocks in `block_tables` [B, nb] as [B, nb *
        block_size, *per_token_shape] in the compute dtype (a sequence's token t at index t)."""
        return tuple(
            self._read(self.store[c.name][layer], self.scales[c.name][layer], block_tables)
            for c in self.spec.components
        )

    def put(self, name: str, layer: int, x: torch.Tensor, rows: torch.Tensor) -> None:
        """Store x [N, *per_token_shape] as rows `rows` [N] int64 of component `name`."""
        c = self._components[name]
        store = _slots(self.store[name][layer])
        if c.quantized:
            x = x.float()
            scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
            store.index_copy_(0, rows, (x / scale).to(torch.float8_e4m3fn).view(torch.uint8))
            _slots(self.scales[name][layer]).index_copy_(0, rows, scale)
        else:
            store.index_copy_(0, rows, x.to(c.dtype, copy=False))

    def take(self, name: str, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` (any shape of int64) of component `name` in the compute dtype:
        [*rows.shape, *per_token_shape]."""
        c = self._components[name]
        flat = rows.reshape(-1)
        x = _slots(self.store[name][layer]).index_select(0, flat)
        if c.quantized:
            s = _slots(self.scales[name][layer]).index_select(0, flat)
            x = (x.view(torch.float8_e4m3fn).float() * s).to(self.compute_dtype)
        elif x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        return x.view(*rows.shape, *c.per_token_shape)

    def rows_of(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """The rows of component `name` whose windows complete within a sequence's tokens
        0..T-1 held at `slots` [T]: one per `rate` tokens, at the window's last token."""
        c = self._components[name]
        ends = slots[c.rate - 1 :: c.rate]
        return ends // min(c.rate, self.spec.block_size)

    def export(self, slots: torch.Tensor | Sequence[torch.Tensor]) -> KVRows:
        """The rows of a sequence's positions 0..T-1, every layer and component, copied out as
        stored. slots: per pool, int64 (the main pool's [T], a window pool's the last
        min(T, window) positions'); one tensor: the main pool's of a one-pool cache."""
        pools = self._pool_slots(slots)
        tensors = {
            name: torch.stack([_slots(t).index_select(0, rows) for t in stored])
            for name, stored, rows in self._row_tensors(pools)
        }
        return KVRows(len(pools[0]), tensors)

    def load(self, slots: torch.Tensor | Sequence[torch.Tensor], rows: KVRows) -> None:
        """Write `rows` (exported from a cache of an equal spec description) into `slots` (per
        pool, as `export` takes them). Raises ValueError if their shapes or dtypes are not this
        cache's."""
        pools = self._pool_slots(slots)
        self.check_rows(rows, len(pools[0]))
        for name, stored, at in self._row_tensors(pools):
            for i, t in enumerate(stored):
                _slots(t).index_copy_(0, at, rows.tensors[name][i])

    def check_rows(self, rows: KVRows, num_tokens: int) -> None:
        """ValueError unless `rows` are `num_tokens` tokens of this cache's shapes and dtypes."""
        slots = [
            torch.arange(num_tokens if w is None else min(w, num_tokens)) for w in self.spec.pools
        ]
        expected = {
            name: ((len(stored), len(at), *stored[0].shape[2:]), stored[0].dtype)
            for name, stored, at in self._row_tensors(slots)
        }
        got = {name: (tuple(t.shape), t.dtype) for name, t in rows.tensors.items()}
        if rows.num_tokens != num_tokens or got != expected:
            raise ValueError(f"KV rows {got} do not fit {num_tokens} tokens here ({expected})")

    def _pool_slots(self, slots: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if isinstance(slots, torch.Tensor):
            if len(self.spec.pools) != 1:
                raise ValueError("a cache of window pools takes slots per pool")
            return [slots]
        if len(slots) != len(self.spec.pools):
            raise ValueError(f"slots of {len(slots)} pools for {len(self.spec.pools)}")
        return list(slots)

    def _row_tensors(
        self, slots: list[torch.Tensor]
    ) -> Iterator[tuple[str, list[torch.Tensor], torch.Tensor]]:
        """What a sequence's rows are, by their KVRows name: each component's per-layer tensors
        as stored (then its scales when it is fp8), and the rows of them that the tokens at
        `slots` (per pool) hold."""
        for c in self.spec.components:
            pool = self.spec.pool_of(c.name)
            rows = self.rows_of(c.name, slots[0]) if pool == 0 else slots[pool]
            yield c.name, list(self.store[c.name].values()), rows
            if c.quantized:
                yield f"{c.name}.scale", list(self.scales[c.name].values()), rows

    def _write_compiled(
        self, layer: int, values: tuple[torch.Tensor, ...], slots: torch.Tensor
    ) -> None:
        assert self.ops is not None  # __init__ picks this path only with ops
        key, value = values
        key_cache, value_cache, key_scale, value_scale = self.layer_storage(layer)
        self.ops.write_kv(key_cache, value_cache, key, value, slots, key_scale, value_scale)

    def _write_torch(
        self, layer: int, values: tuple[torch.Tensor, ...], slots: torch.Tensor
    ) -> None:
        for c, x in zip(self.spec.components, values, strict=True):
            self.put(c.name, layer, x, slots)

    def _decode_compiled(
        self, q: torch.Tensor, layer: int, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        assert self.ops is not None  # __init__ picks this path only with ops
        key, value, key_scale, value_scale = self.layer_storage(layer)
        return self.ops.decode_attention(
            q,
            key,
            value,
            key_scale,
            value_scale,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            meta.sliding_window or 0,
        )

    def _decode_sdpa(
        self, q: torch.Tensor, layer: int, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """The reference: the blocks gathered, then SDPA under meta.decode_mask, each row over
        its context padded (masked) to a multiple of `SDPA_SPAN` tokens and run with the rows
        of the same padded length. So a row's arithmetic depends on its own context only, not on
        the block size or the rows batched with it (SDPA's reductions split by length)."""
        ck, cv = self.gather(layer, meta.decode_block_tables)  # [nd, L, Hkv, D]
        spans = (meta.decode_context_lens + SDPA_SPAN - 1) // SDPA_SPAN * SDPA_SPAN
        out = torch.empty_like(q)
        groups = sorted(set(spans.tolist()))
        for span in groups:
            if len(groups) == 1:  # every row: no copies
                rows: slice | torch.Tensor = slice(None)
            else:
                rows = (spans == span).nonzero().squeeze(1)
            keys, values, mask = ck[rows], cv[rows], meta.decode_mask[rows]
            if keys.shape[1] != span:  # cut or pad (past every row's context: masked)
                keys, values = (_to_length(t, span, dim=1) for t in (keys, values))
                mask = _to_length(mask, span, dim=3)
            out[rows] = F.scaled_dot_product_attention(
                q[rows].unsqueeze(2),  # [n, Hq, 1, D]
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            ).squeeze(2)
        return out

    def _read(
        self, store: torch.Tensor, scales: torch.Tensor, tables: torch.Tensor
    ) -> torch.Tensor:
        b, nb = tables.shape
        flat = tables.reshape(-1)
        x = store.index_select(0, flat).view(b, nb * store.shape[1], *store.shape[2:])
        if store.dtype == torch.uint8:  # fp8
            s = scales.index_select(0, flat).view(b, nb * store.shape[1], *scales.shape[2:])
            return (x.view(torch.float8_e4m3fn).float() * s).to(self.compute_dtype)
        return x if x.dtype == self.compute_dtype else x.to(self.compute_dtype)


PREFILL_GROUP_MAX = 48  # query heads per KV head the compiled prefill attention takes
SDPA_SPAN = 256  # tokens: the PyTorch decode path's unit of key length


def _to_length(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """t cut or zero-padded (False for a bool mask) along `dim` to `length`."""
    if t.shape[dim] >= length:
        return t.narrow(dim, 0, length)
    pad = list(t.shape)
    pad[dim] = length - t.shape[dim]
    return torch.cat([t, t.new_zeros(pad)], dim=dim)


def _slots(blocks: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, ...] viewed as [num_slots, ...]."""
    return blocks.view(-1, *blocks.shape[2:])
