"""The child processes of `thermostat pd` (thermostat.disagg.launcher): each started in its own
process group with its output in a log file, polled until its readiness URL answers 200, and
stopped with SIGTERM, then SIGKILL to its whole group after a grace period."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

POLL_S = 0.25


def local_url(host: str, port: int) -> str:
    """The URL to reach a listener bound to `host` from this machine."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def free_ports(count: int) -> list[int]:
    """`count` different ports free on 127.0.0.1 now (all bound at once, then released)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


@dataclass
class Child:
    """A process this launcher started; stdout and stderr go to `log`."""

    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes]
    log: Path
    ready_url: str  # GET answers 200 once the child is ready

    def tail(self, lines: int = 20) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def exit_reason(self) -> str:
        code = self.proc.returncode
        if code is not None and code < 0:
            return f"{self.name} was killed by {signal.Signals(-code).name}"
        return f"{self.name} exited with status {code}"


class LaunchError(Exception):
    """A child exited on its own, or was not ready in time."""

    def __init__(self, message: str, child: Child) -> None:
        super().__init__(message)
        self.child = child


def start(name: str, argv: Sequence[str], ready_url: str, log_dir: Path) -> Child:
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0,  # its own group: see the module docstring
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return Child(name, list(argv), proc, log, ready_url)


def first_exited(children: Sequence[Child]) -> Child | None:
    return next((c for c in children if c.proc.poll() is not None), None)


def is_ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(
    waiting: Sequence[Child],
    timeout_s: float,
    running: Sequence[Child] = (),
    on_wait: Callable[[list[Child], float], None] | None = None,
) -> None:
    """Returns once every child in `waiting` is ready. Raises LaunchError when one of `waiting`
    or `running` exits first, or when `timeout_s` passes; `on_wait(pending, elapsed_s)` is
    called between polls."""
    t0 = time.monotonic()
    pending = list(waiting)
    while True:
        gone = first_exited([*running, *waiting])
        if gone is not None:
            raise LaunchError(f"{gone.exit_reason()} before everything was ready", gone)
        pending = [c for c in pending if not is_ready(c.ready_url)]
        elapsed = time.monotonic() - t0
        if not pending:
            return
        if elapsed > timeout_s:
            names = ", ".join(c.name for c in pending)
            raise LaunchError(f"{names} not ready after {timeout_s:.0f} s", pending[0])
        if on_wait is not None:
            on_wait(pending, elapsed)
        time.sleep(POLL_S)


def wait_any_exit(children: Sequence[Child]) -> Child:
    """Blocks until a child exits and returns it (Ctrl-C and SIGTERM interrupt the wait)."""
    while (gone := first_exited(children)) is None:
        time.sleep(POLL_S)
    return gone


def stop(children: Sequence[Child], grace_s: float) -> None:
    """SIGTERM to each child still running, all at once; whichever still runs `grace_s` later
    is killed with its whole process group."""
    running = [c for c in children if c.proc.poll() is None]
    for child in running:
        child.proc.terminate()
    deadline = time.monotonic() + grace_s
    for child in running:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
