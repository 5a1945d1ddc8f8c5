"""DeepSeek-V4's cache, from its architecture alone (no model needed): the components the engine
stores (`v4_cache_spec`) and what the config's shapes require a decoder to keep
(`v4_cache_requirement`, /work/shared/deepseek-v4.md section 3), so the two can be compared.

Components per layer (D = head_dim, rd = rope dim, Di = index_dim, W = sliding_window; `dtype`
the KV cache dtype, `model` the model dtype; window = positions read behind a step's first new
token, thermostat.models.v4_step):

| component          | layers | rate     | values      | dtype        | window          |
|--------------------|--------|----------|-------------|--------------|-----------------|
| kv_nope, kv_rope   | all    | 1        | D - rd, rd  | dtype, model | W - 1           |
| csa_state          | CSA    | 1        | 4 D + 4 Di  | model        | 2 r_csa - 1     |
| csa_nope, csa_rope | CSA    | r_csa    | D - rd, rd  | dtype, model | (all)           |
| index              | CSA    | r_csa    | Di          | dtype        | (all)           |
| hca_state          | HCA    | 1        | 2 D         | model        | r_hca - 1       |
| hca_nope, hca_rope | HCA    | r_hca    | D - rd, rd  | dtype, model | (all)           |

The requirement, per layer: W window rows, 2 r_csa rows of CSA compressor state and of the
indexer's (kv and gate of two windows), r_hca rows of HCA state, and the entries at their rates.
Its row sizes: fp8 rows as SGLang and vLLM lay them out (D - rd e4m3, rd in bf16, one ue8m0
scale per 64 values, padded to 8 bytes; an index key Di e4m3 and a float32 scale), others
values times the dtype's size; compressor state in `state_dtype` (the note's table: float32,
as SGLang and vLLM keep it; the engine keeps it in the model dtype).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from thermostat.models.kv_spec import CacheComponent, KVCacheSpec

if TYPE_CHECKING:
    from thermostat.models.deepseek_v4 import V4Arch


def state_width(arch: V4Arch, kind: str) -> int:
    """Values of one `<kind>_state` row: the compressor's kv and gate (2D each with CSA's
    overlap, else D), then for CSA the indexer's (2 index_dim each)."""
    d, di = arch.attn.head_dim, arch.attn.index_dim
    return 4 * d + 4 * di if kind == "csa" else 2 * d


def state_window(kind: str, rate: int) -> int:
    """Positions of `<kind>_state` read behind a step's first new token s: back to
    (s // r) * r - r with CSA's overlap, else (s // r) * r."""
    return 2 * rate - 1 if kind == "csa" else rate - 1


def v4_cache_spec(
    arch: V4Arch, block_size: int, dtype: torch.dtype, model_dtype: torch.dtype
) -> KVCacheSpec:
    """The table above as a KVCacheSpec."""
    d, rd = arch.attn.head_dim, arch.attn.rope_dim
    window = arch.attn.window - 1
    components = [
        CacheComponent("kv_nope", (d - rd,), dtype, window=window),
        CacheComponent("kv_rope", (rd,), model_dtype, window=window),
    ]
    for kind in ("csa", "hca"):
        layers, rate = arch.layers_of(kind), arch.rates[kind]
        if not layers:
            continue
        width = (state_width(arch, kind),)
        components += [
            CacheComponent(
                f"{kind}_state", width, model_dtype, 1, layers, state_window(kind, rate)
            ),
            CacheComponent(f"{kind}_nope", (d - rd,), dtype, rate, layers),
            CacheComponent(f"{kind}_rope", (rd,), model_dtype, rate, layers),
        ]
        if kind == "csa":
            index = (arch.attn.index_dim,)
            components.append(CacheComponent("index", index, dtype, rate, layers))
    return KVCacheSpec(arch.num_layers, block_size, tuple(components))


def _row_bytes(values: int, rope: int, dtype: torch.dtype) -> int:
    """A K=V row or entry (`rope` of its values roped), or an index key (rope 0)."""
    if dtype != torch.float8_e4m3fn:
        return values * dtype.itemsize
    if rope == 0:
        return values + 4  # e4m3 and a float32 scale
    nope = values - rope
    scales = -(-nope // 64)
    return -(-(nope + 2 * rope + scales) // 8) * 8  # e4m3, bf16 rope, ue8m0 scales, padded


def v4_cache_requirement(
    arch: V4Arch, kv_dtype: torch.dtype, state_dtype: torch.dtype
) -> tuple[float, int]:
    """(bytes per token of context, fixed bytes per sequence) that V4's shapes require (see
    the module docstring for the row sizes)."""
    d, rd, di = arch.attn.head_dim, arch.attn.rope_dim, arch.attn.index_dim
    csa, hca = len(arch.layers_of("csa")), len(arch.layers_of("hca"))
    r_csa, r_hca = arch.rates["csa"], arch.rates["hca"]
    entry = _row_bytes(d, rd, kv_dtype)
    per_token = csa * (entry + _row_bytes(di, 0, kv_dtype)) / r_csa + hca * entry / r_hca
    state = state_dtype.itemsize
    fixed = arch.num_layers * arch.attn.window * entry
    fixed += csa * 2 * r_csa * state_width(arch, "csa") * state  # CSA's and the indexer's
    fixed += hca * r_hca * state_width(arch, "hca") * state
    return per_token, fixed
