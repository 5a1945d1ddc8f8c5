"""Run the gateway under uvicorn: ready once the socket listens and the upstream answered; on
SIGTERM a drain (new requests 503, those in flight finish), then exit 0 (`DrainingServer`)."""

from __future__ import annotations

from fastapi import FastAPI

from thermostat.api.lifecycle import DrainingServer
from thermostat.gateway.config import GatewayConfig
from thermostat.gateway.state import GatewayState


class GatewayServer(DrainingServer):
    def __init__(self, app: FastAPI, config: GatewayConfig, log_level: str = "info") -> None:
        super().__init__(app, config, log_level)
        self.state: GatewayState = app.state.thermostat
