"""Run the app with uvicorn: readiness once the socket listens, and a graceful drain
(`DrainingServer`: new requests 503 while those in flight finish, then the engine thread stops
and the process exits 0)."""

from __future__ import annotations

from fastapi import FastAPI

from thermostat.api.lifecycle import DrainingServer
from thermostat.server.config import ServerConfig
from thermostat.server.state import ServerState


class ThermostatServer(DrainingServer):
    """The model server under uvicorn."""

    def __init__(self, app: FastAPI, config: ServerConfig, log_level: str = "info") -> None:
        super().__init__(app, config, log_level)
        self.state: ServerState = app.state.thermostat
