"""Run the app with uvicorn: readiness once the socket listens, and a graceful drain.

On SIGTERM (or SIGINT) the server drains: it keeps listening and answers 503 to every new
request while the requests in flight finish (at most `drain_timeout_s`), then closes its
sockets, stops the engine thread and exits with status 0 (a drain is a clean exit, not a death
by signal).
"""

from __future__ import annotations

import math
import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from thermostat.server.app import create_app
from thermostat.server.config import ServerConfig
from thermostat.server.state import ServerState


class ThermostatServer(uvicorn.Server):
    """uvicorn, telling the app when it listens and when it starts to drain."""

    def __init__(self, app: FastAPI, config: ServerConfig, log_level: str = "info") -> None:
        self.state: ServerState = app.state.thermostat
        super().__init__(
            uvicorn.Config(
                app,
                host=config.host,
                port=config.port,
                log_level=log_level,
                log_config=None,  # the caller's logging setup stays in charge
                access_log=False,  # every generation request gets its own structured line
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
        self.state.begin_draining()  # at once: uvicorn notices should_exit on its next tick
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:  # uvicorn would re-raise it after the drain: exit 143
            self._captured_signals.remove(sig)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.begin_draining()  # new requests get 503 from here on
        await self.state.drain()  # still listening: new connections get the 503 too
        await super().shutdown(sockets)


def serve(config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT; the exit code is 1 if the model failed to load."""
    app = create_app(config)
    server = ThermostatServer(app, config)
    server.run()
    return 1 if server.state.status == "failed" else 0
