"""Run the gateway under uvicorn: ready once the socket listens and the upstream answered; on
SIGTERM a drain (new requests 503, those in flight finish), then exit 0."""

from __future__ import annotations

import math
import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from thermostat.gateway.config import GatewayConfig
from thermostat.gateway.state import GatewayState


class GatewayServer(uvicorn.Server):
    def __init__(self, app: FastAPI, config: GatewayConfig, log_level: str = "info") -> None:
        self.state: GatewayState = app.state.thermostat
        super().__init__(
            uvicorn.Config(
                app,
                host=config.host,
                port=config.port,
                log_level=log_level,
                log_config=None,
                access_log=False,
                timeout_graceful_shutdown=max(1, math.ceil(config.drain_timeout_s)),
                lifespan="on",
            )
        )
        self.state.on_fatal = self._fatal

    def _fatal(self) -> None:
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.servers and self.servers[0].sockets:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.state.mark_listening(f"http://{host}:{port}")

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.state.begin_draining()
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:  # a drain is a clean exit, not a death by signal
            self._captured_signals.remove(sig)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.begin_draining()
        await self.state.drain()
        await super().shutdown(sockets)
