"""The OpenAI-compatible HTTP server: FastAPI over an engine thread.

`create_app(ServerConfig)` builds the app (imported on first use, and with it the engine and
torch); `api.lifecycle.DrainingServer` runs it with uvicorn, a startup report, readiness and a
graceful drain on SIGTERM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from thermostat.server.config import ServerConfig

if TYPE_CHECKING:
    from thermostat.server.app import create_app

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from thermostat.server.app import create_app

        return create_app
    raise AttributeError(f"module 'thermostat.server' has no attribute {name!r}")
