"""Server settings, fixed at startup."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from thermostat.api.config import EdgeConfig
from thermostat.api.tool_parsers import PARSERS
from thermostat.engine.config import EngineConfig


@dataclass(frozen=True, kw_only=True)
class ServerConfig(EdgeConfig):
    """What `thermostat serve` was started with (engine settings included)."""

    engine: EngineConfig = field(default_factory=EngineConfig)  # .model: "demo" or a directory
    served_model_name: str | None = None  # default: the model directory's name
    # Prefill/decode disaggregation (SGLang's flag names): None serves whole requests.
    disaggregation_mode: Literal["prefill", "decode"] | None = None
    bootstrap_port: int = 8998  # prefill: where decodes claim their KV (SGLang's default)
    disaggregation_timeout_s: float = 60.0  # decode: wait for a room; prefill: keep one
    tool_call_parser: str | None = None  # server/tool_parsers.py PARSERS; None: by model family

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.bootstrap_port <= 65535:
            raise ValueError(f"bootstrap port must be in [0, 65535], got {self.bootstrap_port}")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            names, got = ", ".join(PARSERS), self.tool_call_parser
            raise ValueError(f"tool call parser must be one of {names}, got {got!r}")
        if self.disaggregation_timeout_s <= 0:
            raise ValueError("disaggregation timeout must be positive")
