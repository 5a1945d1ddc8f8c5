"""What the engine says once, when it is ready: the model, the KV cache against its budget,
the kernels, speculation, the weights, what a token of context costs."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from thermostat import kernels
from thermostat.models.kv_spec import KVCacheSpec

if TYPE_CHECKING:
    from thermostat.engine.llm_engine import LLMEngine

log = logging.getLogger("thermostat.engine")


def log_ready(engine: LLMEngine, spec: KVCacheSpec, pools: list[int]) -> None:
    config, arch, num_blocks = engine.config, engine.loaded.arch, pools[0]
    kv_bytes = sum(n * spec.pool_bytes_per_block(p) for p, n in enumerate(pools))
    log.info(
        "engine ready: %s (%s, %s), KV cache %d blocks x %d tokens (%s, %.2f of %g GB: "
        "at most twice what max_num_seqs sequences of max_model_len hold), CPU kernels %s",
        engine.loaded.path,
        arch.architecture,
        engine.loaded.dtype,
        num_blocks,
        config.block_size,
        spec.dtype,
        kv_bytes / 2**30,
        config.kv_cache_memory_gb,
        kernels.status() if config.cpu_kernels else "off (cpu_kernels=False)",
    )
    speculation = config.speculation
    if speculation.on and not engine.scheduler.speculation.on:
        log.warning(
            "speculative decoding (%s) is off: a cache with window pools (%s) keeps state "
            "a rejected proposal would change",
            speculation.method,
            arch.architecture,
        )
    elif speculation.on:
        source = (
            "the checkpoint's next-n layer"
            if speculation.method == "mtp"
            else f"n-grams up to {speculation.ngram}"
        )
        log.info(
            "speculative decoding: %s, up to %d tokens proposed per step (%s), "
            "while at most %d requests run",
            speculation.method,
            engine.scheduler.speculation.k,
            source,
            speculation.max_running,
        )
    log.info(
        "weights: %s from %s, %.1f MB%s",
        engine.loaded.weight_format,
        engine.loaded.weight_source,
        engine.loaded.weight_bytes / 1e6,
        " (quantized at load: --quantization)" if config.quantization else "",
    )
    log.info(
        "KV bytes per token of context %.1f, fixed per sequence %d%s",
        engine.kv_bytes_per_token,
        engine.kv_fixed_bytes_per_sequence,
        "".join(
            f", window {w} pool {n} blocks" for w, n in zip(spec.pools[1:], pools[1:], strict=True)
        ),
    )
