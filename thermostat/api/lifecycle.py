"""uvicorn, telling an app when it listens and when to drain, and `notify` to tell systemd;
shared by `serve` and `gateway`.

On SIGTERM (or SIGINT) the app drains: it keeps listening and answers 503 to every new request
while the requests in flight finish (at most `drain_timeout_s`), then the sockets close and the
process exits with status 0 (a drain is a clean exit, not a death by signal). Torch-free: the
gateway runs where torch is not installed.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Callable
from types import FrameType
from typing import Protocol

import uvicorn
from fastapi import FastAPI

log = logging.getLogger("thermostat.server")


class Lifecycle(Protocol):
    """What an app's state (`app.state.thermostat`) offers the server."""

    on_fatal: Callable[[], None]
    status: str  # "failed": the process exits 1

    def mark_listening(self, address: str) -> None: ...
    def begin_draining(self) -> None: ...
    async def drain(self) -> None: ...


class Listen(Protocol):
    """Where to listen and how long a drain may take (ServerConfig, GatewayConfig)."""

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def drain_timeout_s(self) -> float: ...


class DrainingServer(uvicorn.Server):
    def __init__(self, app: FastAPI, config: Listen, log_level: str = "info") -> None:
        self.lifecycle: Lifecycle = app.state.thermostat
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
        self.lifecycle.on_fatal = self._fatal

    def _fatal(self) -> None:
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.servers and self.servers[0].sockets:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.lifecycle.mark_listening(f"http://{host}:{port}")

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.lifecycle.begin_draining()  # at once: uvicorn notices should_exit on its next tick
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:  # uvicorn would re-raise it after the drain: exit 143
            self._captured_signals.remove(sig)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.lifecycle.begin_draining()  # new requests get 503 from here on
        await self.lifecycle.drain()  # still listening: new connections get the 503 too
        await super().shutdown(sockets)


def serve_until_stopped(server: DrainingServer) -> int:
    """Log to stderr and serve until SIGTERM/SIGINT; the exit code is 1 if the app failed (a
    model that did not load, defaults that cannot apply), else 0."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    server.run()
    return 1 if server.lifecycle.status == "failed" else 0


def notify(state: str) -> bool:
    """sd_notify(3) without libsystemd: send `state` ("READY=1\\nSTATUS=...", "STOPPING=1") to
    the socket in $NOTIFY_SOCKET. True if sent; False when not under systemd (no variable) or
    when sending failed (logged as a warning). Never raises: readiness reporting must not take
    a server down."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # the abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode(), address)
    except (OSError, ValueError) as exc:  # ValueError: a state that does not encode
        log.warning("sd_notify to %r failed: %s", os.environ.get("NOTIFY_SOCKET"), exc)
        return False
    return True
