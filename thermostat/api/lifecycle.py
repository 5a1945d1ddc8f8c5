"""uvicorn, telling an app when it listens and when to drain, and `notify` to tell systemd;
shared by `serve` and `gateway`.

On SIGTERM (or SIGINT) the app drains: it keeps listening and answers 503 to every new request
while the requests in flight finish (at most `drain_timeout_s`), then the sockets close and the
process exits with status 0 (a drain is a clean exit, not a death by signal). Torch-free: the
gateway runs where torch is not installed.

A server process (`serve_until_stopped`) freezes Python's garbage-collected heap once it is ready:
what startup built (the model, the tokenizer, the libraries, some 300,000 objects) moves to the
permanent generation, so a collection scans only what requests allocated since. Unfrozen, every
full collection walks that whole heap: measured at one stream (SmolLM2-135M-shaped bf16, 2 cores),
a fifth of the server's CPU samples were the collector's, on the threads that drive the engine.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Callable
from types import FrameType
from typing import Literal

import uvicorn
from fastapi import FastAPI

from thermostat.api.config import EdgeConfig

log = logging.getLogger("thermostat.server")


Status = Literal["loading", "ready", "draining", "failed"]


class Lifecycle:
    """An app's state (`app.state.thermostat`) as the server sees it, `serve`'s and the
    gateway's alike:

        loading ──(what it serves is in hand: a model, an upstream)──► ready ──(SIGTERM)──► draining
            └──(it cannot serve: a model that does not load, defaults that cannot apply)──► failed

    The readiness line is logged once, when the app is ready AND its socket listens; under
    systemd (Type=notify) READY=1 is sent then, and STOPPING=1 when the drain begins."""

    def __init__(self, logger: logging.Logger) -> None:
        self.status: Status = "loading"
        self.address: str | None = None  # http://host:port once listening
        self.route_paths: set[str] = set()
        self.on_fatal: Callable[[], None] = lambda: None  # asks the server process to exit
        self.log = logger
        self.freeze_heap_when_ready = False  # set by serve_until_stopped: the process is ours
        self._announced = False

    def serving_line(self) -> str:
        """What the readiness line says this app serves, e.g. "serving 'demo'"."""
        raise NotImplementedError

    async def drain(self) -> None:
        """Wait until no request is in flight (at most the drain timeout); idempotent."""
        raise NotImplementedError

    def mark_ready(self) -> None:
        if self.status == "loading":
            self.status = "ready"
        self._announce()

    def fail(self, why: str, *args: object, traceback: bool = False) -> None:
        """Log why, then exit 1 (`serve_until_stopped`)."""
        self.log.error(why, *args, exc_info=traceback)
        self.status = "failed"
        self.on_fatal()

    def mark_listening(self, address: str) -> None:
        self.address = address
        self._announce()

    def _announce(self) -> None:
        if self.status == "ready" and self.address and not self._announced:
            self._announced = True
            what, url = self.serving_line(), self.address
            self.log.info("ready: %s at %s (OpenAI API under %s/v1)", what, url, url)
            notify(f"READY=1\nSTATUS={what} at {url}")
            if self.freeze_heap_when_ready:
                gc.collect()  # startup's garbage goes first: frozen, it would stay for good
                gc.freeze()

    def report_defaults(self, table: str, warnings: list[str]) -> None:
        """The startup report's sampling defaults: the table, then what looks wrong."""
        self.log.info("sampling defaults\n%s", table.rstrip())
        for warning in warnings:
            self.log.warning("sampling: %s", warning)

    def begin_draining(self) -> None:
        if self.status in ("loading", "ready"):
            self.status = "draining"
            self.log.info("draining: refusing new requests, finishing those in flight")
            notify("STOPPING=1\nSTATUS=draining")


class DrainingServer(uvicorn.Server):
    def __init__(self, app: FastAPI, config: EdgeConfig, log_level: str = "info") -> None:
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
    server.lifecycle.freeze_heap_when_ready = True
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
