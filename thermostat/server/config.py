"""Server settings, fixed at startup."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from thermostat.engine.config import EngineConfig
from thermostat.sampling import Policy
from thermostat.server.tool_parsers import PARSERS


@dataclass(frozen=True)
class ServerConfig:
    """What `thermostat serve` was started with (engine settings included)."""

    engine: EngineConfig = field(default_factory=EngineConfig)  # .model: "demo" or a directory
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the model directory's name
    # Parsed --sampling-defaults: operator values, the word "recommended", or None.
    sampling_defaults: dict[str, Any] | str | None = None
    policy: Policy = field(default_factory=Policy)
    max_queue: int | None = None  # 503 + Retry-After once this many requests are waiting
    api_key: str | None = None  # Bearer token required on /v1, /tokenize, /detokenize
    drain_timeout_s: float = 60.0  # on SIGTERM, how long in-flight requests may finish
    retry_after_s: int = 1  # the Retry-After of a queue-full 503
    max_body_bytes: int = 16 * 2**20  # larger request bodies get a 413 before they are read
    # Prefill/decode disaggregation (SGLang's flag names): None serves whole requests.
    disaggregation_mode: Literal["prefill", "decode"] | None = None
    bootstrap_port: int = 8998  # prefill: where decodes claim their KV (SGLang's default)
    disaggregation_timeout_s: float = 60.0  # decode: wait for a room; prefill: keep one
    tool_call_parser: str | None = None  # server/tool_parsers.py PARSERS; None: by model family

    def __post_init__(self) -> None:
        if self.max_queue is not None and self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.bootstrap_port <= 65535:
            raise ValueError(f"bootstrap port must be in [0, 65535], got {self.bootstrap_port}")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            names, got = ", ".join(PARSERS), self.tool_call_parser
            raise ValueError(f"tool call parser must be one of {names}, got {got!r}")
        if self.disaggregation_timeout_s <= 0:
            raise ValueError("disaggregation timeout must be positive")
