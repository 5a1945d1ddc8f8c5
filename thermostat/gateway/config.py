"""Gateway settings, fixed at startup."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thermostat.gateway.kinds import KINDS
from thermostat.sampling import Policy


@dataclass(frozen=True)
class GatewayConfig:
    """What `thermostat gateway` was started with."""

    upstream: str  # base URL, e.g. http://127.0.0.1:30000
    upstream_kind: str = "auto"  # a KINDS name, or "auto" (found from the upstream's routes)
    upstream_api_key: str | None = None  # sent upstream; the client's key never is
    upstream_timeout_s: float = 300.0  # the longest silence from the upstream
    generation_config: Path | None = None  # the model's generation_config.json, or its dir
    host: str = "127.0.0.1"
    port: int = 8000
    sampling_defaults: dict[str, Any] | str | None = None  # parsed --sampling-defaults
    policy: Policy = field(default_factory=Policy)
    stop_on_loop: bool = False
    api_key: str | None = None  # required from clients on /v1
    max_queue: int | None = None  # 503 + Retry-After once this many requests are in flight
    drain_timeout_s: float = 60.0
    retry_after_s: int = 1
    max_body_bytes: int = 16 * 2**20
    discovery_retry_s: float = 2.0  # while the upstream does not answer at startup

    def __post_init__(self) -> None:
        if not self.upstream.startswith(("http://", "https://")):
            raise ValueError(f"--upstream must be an http(s) URL, got {self.upstream!r}")
        if self.upstream_kind != "auto" and self.upstream_kind not in KINDS:
            raise ValueError(f"unknown upstream kind {self.upstream_kind!r}")
        if self.upstream_timeout_s <= 0:
            raise ValueError("--upstream-timeout must be positive")
        if self.max_queue is not None and self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.generation_config is not None and not self.generation_config.exists():
            raise ValueError(f"generation config not found: {self.generation_config}")
