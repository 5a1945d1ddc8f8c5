"""The settings every OpenAI edge has (`serve`'s ServerConfig and the gateway's GatewayConfig
extend it), and how its flags (api/arguments.py) become them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from thermostat.sampling import Policy
from thermostat.sampling.spec import parse_sampling_spec


@dataclass(frozen=True, kw_only=True)
class EdgeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Parsed --sampling-defaults: operator values, the word "recommended", or None.
    sampling_defaults: dict[str, Any] | str | None = None
    policy: Policy = field(default_factory=Policy)
    api_key: str | None = None  # Bearer token required on /v1 (and serve's /tokenize ...)
    max_queue: int | None = None  # 503 + Retry-After once this many requests wait / are in flight
    drain_timeout_s: float = 60.0  # on SIGTERM, how long in-flight requests may finish
    retry_after_s: int = 1  # the Retry-After of a queue-full 503
    max_body_bytes: int = 16 * 2**20  # larger request bodies get a 413 before they are read
    console: bool = True  # GET /console (api/console.py)
    console_keep_text: bool = False  # the console's recent requests keep prompt and output text
    responses_store_size: int = 1024  # /v1/responses: stored responses kept, oldest dropped

    def __post_init__(self) -> None:
        if self.max_queue is not None and self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, got {self.responses_store_size}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")


def edge_options(args: argparse.Namespace) -> dict[str, Any]:
    """EdgeConfig's fields from the shared flags; raises ValueError (SpecError) for a bad one."""
    return dict(
        host=args.host,
        port=args.port,
        sampling_defaults=parse_sampling_spec(args.sampling_defaults),
        policy=Policy(min_temperature=args.min_temperature, greedy=args.greedy),
        api_key=args.api_key,
        max_queue=args.max_queue,
        drain_timeout_s=args.drain_timeout,
        max_body_bytes=int(args.max_body_mb * 2**20),
        console=not args.no_console,
        console_keep_text=args.console_keep_text,
        responses_store_size=args.responses_store_size,
    )
