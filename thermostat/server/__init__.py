"""The OpenAI-compatible HTTP server: FastAPI over an engine thread.

`create_app(ServerConfig)` builds the app; `launch.serve(ServerConfig)` runs it with uvicorn,
a startup report, readiness and a graceful drain on SIGTERM.
"""

from __future__ import annotations

from thermostat.server.app import create_app
from thermostat.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
