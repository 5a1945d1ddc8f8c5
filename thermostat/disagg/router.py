"""The router in front of a prefill and a decode server: SGLang's `smg`, set to fail fast.

Thermostat does not route: its workers speak the worker contract of `smg` (PyPI `smg==1.13.0`),
and this module only builds the `smg launch` command line for one prefill and one decode server.
smg's defaults suit a large fleet, where a retry lands on another worker; with one worker per
role a retry lands on the same one, and a 60 s open circuit blacks out the whole pool. The
settings here fail in milliseconds and recover within seconds (see `smg_command`).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

SMG_INSTALL_HINT = "pip install smg==1.13.0"
# smg serves both on its main port: /health is liveness (200 with no worker at all), /readiness
# answers 200 only once a healthy prefill and a healthy decode worker are registered.
ROUTER_READY_PATH = "/readiness"
LOG_LEVELS = ("debug", "info", "warn", "error")

# (smg flag, RouterConfig field): the fail-fast settings, in the order smg_command passes them.
FAIL_FAST_FLAGS: tuple[tuple[str, str], ...] = (
    ("--retry-max-retries", "retry_max_retries"),
    ("--retry-initial-backoff-ms", "retry_initial_backoff_ms"),
    ("--retry-max-backoff-ms", "retry_max_backoff_ms"),
    ("--cb-failure-threshold", "cb_failure_threshold"),
    ("--cb-success-threshold", "cb_success_threshold"),
    ("--cb-timeout-duration-secs", "cb_timeout_duration_secs"),
    ("--cb-window-duration-secs", "cb_window_duration_secs"),
    ("--health-failure-threshold", "health_failure_threshold"),
    ("--health-success-threshold", "health_success_threshold"),
    ("--health-check-timeout-secs", "health_check_timeout_secs"),
    ("--health-check-interval-secs", "health_check_interval_secs"),
    ("--health-check-endpoint", "health_check_endpoint"),
    ("--worker-startup-timeout-secs", "worker_startup_timeout_secs"),
    ("--worker-startup-check-interval", "worker_startup_check_interval"),
    ("--request-timeout-secs", "request_timeout_secs"),
    ("--shutdown-grace-period-secs", "shutdown_grace_secs"),
)


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """One smg router over one prefill and one decode server. Every listener binds loopback
    unless the operator names another host. Units: `_ms` milliseconds, `_secs` seconds."""

    host: str = "127.0.0.1"
    port: int
    prometheus_host: str = "127.0.0.1"  # metrics stay local even when `host` is public
    prometheus_port: int
    prefill_url: str
    bootstrap_port: int  # the prefill server's KV bootstrap port, passed to decode per request
    decode_url: str
    # Fail fast, recover in seconds; smg's defaults and the reasons are in smg_command.
    retry_max_retries: int = 2  # smg counts attempts: the first try and one retry
    retry_initial_backoff_ms: int = 100
    retry_max_backoff_ms: int = 500
    cb_failure_threshold: int = 3
    cb_success_threshold: int = 1
    cb_timeout_duration_secs: int = 2
    cb_window_duration_secs: int = 10
    health_failure_threshold: int = 2
    health_success_threshold: int = 1
    health_check_timeout_secs: int = 2
    health_check_interval_secs: int = 1
    health_check_endpoint: str = "/health"
    worker_startup_timeout_secs: int = 600
    worker_startup_check_interval: int = 1
    request_timeout_secs: int = 600
    shutdown_grace_secs: int = 30
    log_level: str = "info"

    def __post_init__(self) -> None:
        for port in (self.port, self.prometheus_port, self.bootstrap_port):
            if not 1 <= port <= 65535:
                raise ValueError(f"port must be in [1, 65535], got {port}")
        for _, name in FAIL_FAST_FLAGS:
            value = getattr(self, name)
            if isinstance(value, int) and value < 1:
                raise ValueError(f"{name} must be >= 1 (smg refuses less), got {value}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")


def smg_command(cfg: RouterConfig, smg: str = "smg") -> list[str]:
    """The argv of `smg launch` for `cfg`, in PD mode, with the fail-fast settings:

    | flag                            | ours | smg's | why                                        |
    |---------------------------------|------|-------|--------------------------------------------|
    | --retry-max-retries             | 2    | 5     | attempts, not retries: one retry; with one |
    |                                 |      |       | worker a retry hits the same one           |
    | --retry-initial-backoff-ms      | 100  | 50    | one short pause before that retry          |
    | --retry-max-backoff-ms          | 500  | 30000 | never wait seconds for a retry             |
    | --cb-failure-threshold          | 3    | 10    | open after 3 failures in a row; while open |
    |                                 |      |       | a request gets its 503 in under 1 ms       |
    | --cb-success-threshold          | 1    | 3     | one good half-open request closes it       |
    | --cb-timeout-duration-secs      | 2    | 60    | half-open after 2 s, not a 60 s blackout   |
    | --cb-window-duration-secs       | 10   | 120   | old failures stop counting sooner          |
    | --health-failure-threshold      | 2    | 3     | unhealthy after 2 missed probes (~2 s)     |
    | --health-success-threshold      | 1    | 2     | back in rotation on the first good probe   |
    | --health-check-timeout-secs     | 2    | 5     | a hung worker is found in seconds; 2 s     |
    |                                 |      |       | spares a busy event loop a false alarm     |
    | --health-check-interval-secs    | 1    | 60    | the smallest smg takes: notice a dead or a |
    |                                 |      |       | restarted worker within about a second     |
    | --health-check-endpoint         | same | same  | /health: Thermostat's is 200 only when     |
    |                                 |      |       | the engine is ready                        |
    | --worker-startup-timeout-secs   | 600  | 1800  | how long registration waits for a worker   |
    |                                 |      |       | still loading its model                    |
    | --worker-startup-check-interval | 1    | 30    | register a worker a second after it is up, |
    |                                 |      |       | not up to 30 s later                       |
    | --request-timeout-secs          | 600  | 1800  | bounds a request stuck on a hung worker    |
    | --shutdown-grace-period-secs    | 30   | 180   | SIGTERM drains in-flight requests for at   |
    |                                 |      |       | most 30 s (within it, a settle of          |
    |                                 |      |       | min(grace/2, 5 s) keeps the port open)     |

    Workers that fail health checks stay registered and are probed again (smg removes them only
    under service discovery), so a restarted server rejoins without restarting the router.
    `--host` and `--prometheus-host` are always passed: smg binds 0.0.0.0 by default.
    """
    argv = [
        smg,
        "launch",
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
        "--prometheus-host",
        cfg.prometheus_host,
        "--prometheus-port",
        str(cfg.prometheus_port),
        "--pd-disaggregation",
        "--prefill",
        cfg.prefill_url,
        str(cfg.bootstrap_port),
        "--decode",
        cfg.decode_url,
    ]
    for flag, name in FAIL_FAST_FLAGS:
        argv += [flag, str(getattr(cfg, name))]
    return [*argv, "--log-level", cfg.log_level]


def find_smg() -> str | None:
    """The `smg` installed beside this Python (its virtual environment) first, then PATH's."""
    beside = Path(sys.executable).with_name("smg")  # not resolved: a venv's python is a link
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("smg")
