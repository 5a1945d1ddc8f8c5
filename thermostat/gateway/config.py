"""Gateway settings, fixed at startup."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from thermostat.api.config import EdgeConfig
from thermostat.gateway.kinds import KINDS


@dataclass(frozen=True, kw_only=True)
class GatewayConfig(EdgeConfig):
    """What `thermostat gateway` was started with."""

    upstream: str  # base URL, e.g. http://127.0.0.1:30000
    upstream_kind: str = "auto"  # a KINDS name, or "auto" (found from the upstream's routes)
    upstream_api_key: str | None = None  # sent upstream; the client's key never is
    upstream_timeout_s: float = 300.0  # the longest silence from the upstream
    generation_config: Path | None = None  # the model's generation_config.json, or its dir
    stop_on_loop: bool = False
    discovery_retry_s: float = 2.0  # while the upstream does not answer at startup

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.upstream.startswith(("http://", "https://")):
            raise ValueError(f"--upstream must be an http(s) URL, got {self.upstream!r}")
        if self.upstream_kind != "auto" and self.upstream_kind not in KINDS:
            raise ValueError(f"unknown upstream kind {self.upstream_kind!r}")
        if self.upstream_timeout_s <= 0:
            raise ValueError("--upstream-timeout must be positive")
        if self.generation_config is not None and not self.generation_config.exists():
            raise ValueError(f"generation config not found: {self.generation_config}")
