"""Thermostat's CPU kernels (cpu_kernels.cpp), compiled for this machine.

Two builds (`build.py`): on a CPU with AVX-512 and VNNI cpu_kernels.cpp (its bf16 dot products
emulated where AVX512-BF16 is missing: Intel Cascade and Ice Lake); on one with AVX2 only
(AMD Zen 2/3, Intel before Cascade Lake) avx2_kernels.cpp, the same ops in 8-float registers; both
compile DecodeStack (decode_stack.h) over their ops. `ops()` is a `CpuOps` of typed calls into the
build that runs here, or None where none can (no AVX2, no C++ compiler, THERMOSTAT_KERNELS=0 in the
environment). The loader calls it once (`load_model(cpu_kernels=...)`) and hands the result to
the model and the KV cache. The module is built by `python -m thermostat.kernels` (which
tools/setup.sh runs) and cached per source, torch, Python, flags and CPU (`build.py`), so a server
start only imports it; why the kernels are off is logged once.

Each op is chosen once, where its user is built, between the compiled call and its PyTorch
reference (the reference is also what the kernels are tested against). These are the only places
that make the choice; forward code calls the function chosen:

| op                     | chosen in (thermostat/models/) | compiled when                          |
|------------------------|--------------------------------|----------------------------------------|
| rms_norm, add_rms_norm | layers.RMSNorm.__init__        | dim % 16 == 0 (q/k norms: never)       |
| rotary                 | gqa.Attention.__init__,        | head_dim % 32 == 0                     |
|                        | mla.MLAttention.__init__       | qk_rope_head_dim % 32 == 0             |
| silu_mul               | layers.MLP.__init__,           | intermediate_size % 16 == 0            |
|                        | moe.Experts.__init__           | moe_intermediate_size % 16 == 0        |
| pack_vnni, linear_vnni | linear.PackedLinear.__init__   | bf16 (every batch size)                |
| linear_swiglu          | layers.MLP.forward             | a packed bf16 gate/up and silu_mul     |
| linear_quant           | linear.QuantLinear (quant.py)  | int8 / int4 weights (every batch size) |
| quant_rows             | linear.QuantEmbedding          | int8 / int4 embeddings                 |
| write_kv               | kv_cache.PagedKVCache.__init__ | key/value in fp8 or the compute dtype  |
| decode_attention       | kv_cache.PagedKVCache.__init__ | key/value in fp8 or the compute dtype, |
|                        |                                | head_dim % 16 == 0 and <= 256          |
| prefill_attention      | kv_cache.PagedKVCache.__init__ | AVX-512 build, compute in bf16,        |
|                        |                                | key/value in bf16 or fp8, head_dim % 32|
|                        |                                | == 0 and <= 256                        |
| DecodeStack            | compiled_decode.compiled_decode| every op of a dense layer compiled     |
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from thermostat.kernels.build import (
    AVX2,
    FULL,
    Build,
    build_failure,
    cache_root,
    load_or_build,
    module_path,
    this_key,
    unavailable_reason,
)

if TYPE_CHECKING:
    import torch

    from thermostat.models.quant import QuantizedWeight

log = logging.getLogger("thermostat.kernels")


@dataclass(frozen=True)
class LinearOps:
    """Typed calls into a compiled module's linear layers. Every op checks its input and raises
    ValueError on a mismatch."""

    module: ModuleType

    def grid_steps(self, blocks: torch.Tensor, affine: bool) -> torch.Tensor:
        """quant.grid_step of blocks [B, 32] float32 (contiguous), compiled: [B]."""
        y: torch.Tensor = self.module.grid_steps(blocks, affine)
        return y

    def quantize_int8(self, weight: torch.Tensor) -> torch.Tensor:
        """A float weight [N, K] (contiguous) -> its int8 records (QuantizedWeight.packed) as
        quant.quantize_int8 and QuantizedWeight.pack make them on blocks that lie on no grid."""
        y: torch.Tensor = self.module.quantize_int8(weight)
        return y

    def quantize_int4(self, weight: torch.Tensor) -> torch.Tensor:
        """A float weight [N, K] (contiguous) -> its int4 records (bits 4, integer zero points)
        as quant.quantize_int4 and QuantizedWeight.pack make them on blocks on no grid."""
        y: torch.Tensor = self.module.quantize_int4(weight)
        return y

    def pack_records(
        self,
        q: torch.Tensor,
        d: torch.Tensor,
        z: torch.Tensor | None,
        m: torch.Tensor | None,
        bits: int,
        out: torch.Tensor | None = None,
        supers: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """QuantizedWeight.pack's records, byte for byte, for every format code (q int8 / uint8
        [N, K]; d float16 [N, K / 32], z int8 and m float16 of its shape, or for codes 6, 9, 10
        and 11 d and m float32, 9's and 11's d [N, K / 16]; 10 and 11 also `supers` [N, K / 256,
        2] float32, the super-blocks' d and dmin; all contiguous), written into `out`
        (contiguous uint8 [ceil(N / 64), ceil(K / 32), bytes per K block]: a fused weight's
        records of one part) where it is given."""
        absent = d.new_empty(0)  # a format without z, m or supers (or no `out`): not read
        y: torch.Tensor = self.module.pack_records(
            q,
            d,
            absent if z is None else z,
            absent if m is None else m,
            absent if supers is None else supers,
            bits,
            absent if out is None else out,
        )
        return y

    def unpack_gguf(
        self, blocks: torch.Tensor, qtype: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A GGUF tensor's blocks [B, block bytes] (uint8, contiguous) of GGML type code `qtype`
        (gguf_blocks' EXACT_TYPES) -> (q int8 [B, weights], d float32 [B, weights / 16], m
        float32 [B, weights / 32]): gguf_blocks.integers and the scale fields, bit for bit."""
        q, d, m = self.module.unpack_gguf(blocks, qtype)
        return q, d, m

    def pack_vnni(self, weight: torch.Tensor) -> torch.Tensor:
        """bf16 weight [N, K] -> the blocked layout `linear_vnni` reads (N, K padded)."""
        y: torch.Tensor = self.module.pack_vnni(weight)
        return y

    def linear_vnni(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, K] bf16 (any M >= 1); packed from `pack_vnni` of W [n, K]; bias [n] or None.
        Returns x W^T + bias [M, n] bf16, each row the same bits whatever M is."""
        y: torch.Tensor = self.module.linear_vnni(x, packed, n, bias)
        return y

    def linear_swiglu(
        self, x: torch.Tensor, packed: torch.Tensor, i: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """silu(gate) * up [M, i] for x [M, K] bf16 and `packed` from `pack_vnni` of the gate/up
        weight [2i, K] (gate rows first, i % 16 == 0), bias [2i] or None: the bits of
        `silu_mul(linear_vnni(x, packed, 2i, bias))`, the product never written out on AMX."""
        y: torch.Tensor = self.module.linear_swiglu(x, packed, i, bias)
        return y

    def uses_amx(self) -> bool:
        """Whether `linear_vnni` runs on AMX tiles on this machine (else bf16 dot products)."""
        amx: bool = self.module.uses_amx()
        return amx

    def bf16_hardware(self) -> bool:
        """Whether bf16 dot products are one instruction here (AVX512-BF16), not emulated."""
        hardware: bool = self.module.bf16_hardware()
        return hardware

    def linear_quant(
        self,
        x: torch.Tensor,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [M, K] (float32, bf16 or fp16, any M >= 1) times an int8 / 4-bit weight packed by
        thermostat.models.quant; bias [n] or None. Returns [M, n] in x's dtype, each row the
        same bits whatever M is."""
        y: torch.Tensor = self.module.linear_quant(
            x, weight.packed, weight.out_features, weight.bits, bias
        )
        return y

    def quant_rows(
        self, weight: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows `ids` [T] int64 of an int8 / 4-bit weight, dequantized: [T, in_features] in
        `dtype` (an embedding lookup; the same values as QuantizedWeight.rows)."""
        y: torch.Tensor = self.module.quant_rows(
            weight.packed, ids, weight.out_features, weight.in_features, weight.bits, dtype
        )
        return y


@dataclass(frozen=True)
class CpuOps(LinearOps):
    """A build's calls: the linear layers and the decode step's other ops. Float ops take
    float32, bfloat16 or float16 (one dtype for all their tensors) and compute in float32."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [N, dim] (unit stride along dim, dim % 16 == 0), weight [dim] -> [N, dim]."""
        y: torch.Tensor = self.module.rms_norm(x, weight, eps)
        return y

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual [N, dim] (contiguous) += x [N, dim], rounded as `residual + x` is; returns
        rms_norm(residual) [N, dim]."""
        y: torch.Tensor = self.module.add_rms_norm(x, residual, weight, eps)
        return y

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates x [T, H, D] (D contiguous, D % 32 == 0; rows and heads may be strided) in
        place, half-split layout; cos, sin [T, D] contiguous. Returns x."""
        self.module.rotary_(x, cos, sin)
        return x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] (gate columns first, I % 16 == 0) -> silu(gate) * up [T, I]."""
        y: torch.Tensor = self.module.silu_mul(gate_up)
        return y

    def write_kv(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        slots: torch.Tensor,
        key_scale: torch.Tensor | None = None,
        value_scale: torch.Tensor | None = None,
    ) -> None:
        """key/value [T, Hkv, D] (D contiguous) into slots [T] int64 of the caches
        [num_blocks, block_size, Hkv, D] (contiguous): of the same dtype, or fp8_e4m3 bytes
        (uint8) with float scales [num_blocks, block_size, Hkv, 1], each token's head vector
        quantized as kv_cache.PagedKVCache.put does."""
        none = key.new_empty(0).float()  # a cache in the compute dtype has no scales
        self.module.write_kv(
            key_cache, value_cache, key, value, slots,
            none if key_scale is None else key_scale, none if value_scale is None else value_scale,
        )  # fmt: skip

    def decode_attention(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        key_scale: torch.Tensor,
        value_scale: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        window: int,
    ) -> torch.Tensor:
        """Attention of one query token per sequence over its blocks, read in place.
        q [B, Hq, D] (D contiguous, D % 16 == 0, D <= 256, Hq % Hkv == 0); caches
        [num_blocks, block_size, Hkv, D] in q's dtype with empty scales, or uint8 fp8_e4m3 bytes
        with float32 scales [num_blocks, block_size, Hkv, 1]; block_tables [B, nb] int64;
        context_lens [B] int64 (the query token included); window 0 = none. Returns [B, Hq, D]."""
        y: torch.Tensor = self.module.decode_attention(
            q, key_cache, value_cache, key_scale, value_scale, block_tables, context_lens, scale,
            window,
        )  # fmt: skip
        return y

    @property
    def has_prefill_attention(self) -> bool:
        """Whether this build has `prefill_attention` (the AVX-512 build; AVX2's has not)."""
        return hasattr(self.module, "prefill_attention")

    def prefill_attention(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        key_scale: torch.Tensor,
        value_scale: torch.Tensor,
        table: torch.Tensor,
        start: int,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of a chunk of one sequence's new tokens, the rows at positions
        start .. start + T - 1, over its context read in place: q [T, Hq, D] bfloat16 (D
        contiguous, D % 32 == 0, Hq / Hkv <= 48), caches [num_blocks, block_size, Hkv, D]
        holding positions 0 .. start + T - 1, bfloat16 (scales empty) or fp8_e4m3 bytes with
        float32 scales [num_blocks, block_size, Hkv, 1], table [nb] int64 (contiguous). Returns
        [T, Hq, D]; a row's bits do not depend on the chunk it arrives in, and an fp8 cache gives
        the bits of a bf16 cache holding its rows dequantized as the SDPA path does."""
        caches = (key_cache, value_cache, key_scale, value_scale)
        y: torch.Tensor = self.module.prefill_attention(q, *caches, table, start, scale)
        return y


_lock = threading.Lock()


def ops() -> CpuOps | None:
    """The kernels of the build that runs here (the full one, else the AVX2 one), or None (the
    reason is logged once and kept in `status()`)."""
    for build in (FULL, AVX2):
        built = build_ops(build)
        if built is not None:
            return built
    return None


def build_ops(build: Build) -> CpuOps | None:
    """`build`'s kernels wherever this CPU can run it, or None: the AVX2 build runs on the
    AVX-512 machines too, where tests hold both builds to the same references."""
    with _lock:
        module = _load(build)
    return None if module is None else CpuOps(module)


def status() -> str:
    """One line for startup logs and bench reports."""
    compiled = ops()
    if compiled is None:
        return f"off ({_reasons[AVX2]})"
    if FULL in _reasons:  # ops() tried it first
        return f"on (AVX2: {_reasons[FULL]})"
    if compiled.uses_amx():
        return "on (AMX)"
    return "on (no AMX)" if compiled.bf16_hardware() else "on (no AMX, bf16 dot products emulated)"


_reasons: dict[Build, str] = {}  # why a build is off, once tried


@functools.cache
def _load(build: Build) -> ModuleType | None:
    """`build`'s module or None (why: `_reasons`, logged), tried once, under `_lock`."""
    module, reason = _build(build)
    if module is None:
        assert reason is not None
        _reasons[build] = reason
        log.info("CPU kernels %s off (%s)", build.what, reason)
    else:
        log.info("CPU kernels %s ready", build.what)
    return module


def _build(build: Build) -> tuple[ModuleType | None, str | None]:
    reason = unavailable_reason(build)
    if reason:
        return None, reason
    key = this_key(build)
    if not module_path(key, build).exists():
        log.info("building CPU kernels into %s (setup does it ahead)", cache_root() / key)
    start = time.perf_counter()
    try:
        module = load_or_build(key, build)
    except Exception as exc:  # no compiler, no ninja, a toolchain without these intrinsics
        return None, build_failure(exc)
    log.debug("%s loaded in %.1f s", build.name, time.perf_counter() - start)
    return module, None
