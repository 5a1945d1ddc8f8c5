"""Engine settings, fixed at startup: `EngineConfig` holds the one set of defaults, the
scheduler's part of it is derived (`SchedulerConfig.of`)."""

from __future__ import annotations

from dataclasses import dataclass

from thermostat.engine.speculative import SpeculativeConfig

QUANTIZATIONS = ("int8", "int4")  # weight formats `quantization` takes (models.quant.FORMATS)


@dataclass(frozen=True)
class EngineConfig:
    model: str = "demo"
    dtype: str = "auto"  # auto (the checkpoint's) | float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"  # auto (model dtype) | bfloat16 | float16 | float32 | fp8_e4m3
    kv_cache_memory_gb: float = 1.0  # memory budget for K/V; sets the number of blocks
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # running requests at once
    # token budget of one step (chunked prefill); prefill speed is flat from 256 to 4096 (within
    # 3%, benchmarks/bench_chunk_budget.py), and a smaller chunk is a shorter step for the
    # decodes beside a long prompt: 512 is within 2% of the fastest at half 1024's stall
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; default: all cores
    stop_on_loop: bool = False  # end a generation once its text certainly ends in a loop
    cpu_kernels: bool = True  # compiled decode kernels where the CPU has them (thermostat.kernels)
    quantization: str | None = None  # int8 | int4: weights quantized at load; None: the dtype
    speculative: str = "off"  # off | ngram (prompt lookup) | mtp (next-n layer): speculative.py
    speculative_k: int = 4  # tokens proposed per step at most
    speculative_ngram: int = 3  # the longest suffix looked up
    speculative_max_running: int = 4  # requests propose only while at most this many run

    def __post_init__(self) -> None:
        checks = {
            "kv_cache_memory_gb": self.kv_cache_memory_gb > 0,
            "block_size": self.block_size >= 1,
            "max_num_seqs": self.max_num_seqs >= 1,
            "max_num_batched_tokens": self.max_num_batched_tokens >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        self.speculation  # noqa: B018 (validates the speculative fields)

    @property
    def speculation(self) -> SpeculativeConfig:
        return SpeculativeConfig(
            self.speculative,
            self.speculative_k,
            self.speculative_ngram,
            self.speculative_max_running,
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's settings: an EngineConfig's, with the model's resolved max_model_len."""

    max_num_seqs: int
    max_num_batched_tokens: int  # token budget of one step
    max_model_len: int
    enable_prefix_caching: bool
    speculation: SpeculativeConfig = SpeculativeConfig()

    @classmethod
    def of(cls, config: EngineConfig, max_model_len: int) -> SchedulerConfig:
        return cls(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_model_len,
            config.enable_prefix_caching,
            config.speculation,
        )
