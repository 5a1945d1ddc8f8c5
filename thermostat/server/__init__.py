"""The OpenAI-compatible HTTP server: FastAPI over an engine thread.

`create_app(ServerConfig)` builds the app; `launch.ThermostatServer` runs it with uvicorn,
a startup report, readiness and a graceful drain on SIGTERM. Both (and with them the engine and
torch) are imported on first use, so the torch-free modules here (protocol, request_params,
errors, metrics, middleware, body_limits) serve the gateway where torch is not installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from thermostat.server.app import create_app
    from thermostat.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from thermostat.server.app import create_app

        return create_app
    if name == "ServerConfig":
        from thermostat.server.config import ServerConfig

        return ServerConfig
    raise AttributeError(f"module 'thermostat.server' has no attribute {name!r}")
