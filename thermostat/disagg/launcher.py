"""`thermostat pd`: a prefill server, a decode server and the smg router on one host.

| step  | what                                                  | bounded by                |
|-------|-------------------------------------------------------|---------------------------|
| start | prefill and decode: `python -m thermostat.cli serve`  |                           |
| wait  | both answer GET /health with 200                      | --startup-timeout (600 s) |
| start | smg, with `smg_command` (fail-fast settings)          |                           |
| wait  | smg answers GET /readiness with 200                   | ROUTER_READY_TIMEOUT_S    |
| run   | until Ctrl-C or SIGTERM (exit 0) or a child exits (1) |                           |
| stop  | smg first, then both servers: SIGTERM, then SIGKILL   | --stop-grace each (30 s)  |

The router stops first so that no new request reaches a draining server. Each child runs in its
own process group: Ctrl-C in a terminal reaches only this process, which then stops the children
in that order, and a SIGKILL reaches whatever a child started. Children log to files; when one
exits on its own, its last lines are printed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Literal
from urllib.parse import urlsplit

import httpx
from rich.console import Console
from rich.text import Text

from thermostat.disagg import children
from thermostat.disagg.router import (
    ROUTER_READY_PATH,
    SMG_INSTALL_HINT,
    RouterConfig,
    find_smg,
    smg_command,
)

HELP = "run a prefill server, a decode server and the smg router on this host"
EPILOG = """examples:
  thermostat pd                                      # the demo model; router on 127.0.0.1:8000
  thermostat pd --model ~/models/Qwen3-0.6B --serve-args "--sampling-defaults recommended"
  thermostat pd --model DIR --port 9000 --log-dir ./pd-logs --startup-timeout 1200

Prefill and decode listen on 127.0.0.1 (free ports unless given); clients use the router.
Ctrl-C stops the router first, then both servers. Needs smg: pip install smg==1.13.0

exit status: 0 after Ctrl-C or SIGTERM, 1 a child exited or was not ready in time,
2 bad flags or smg not installed.
"""

Role = Literal["prefill", "decode"]
SERVER_CMD = (sys.executable, "-m", "thermostat.cli")  # followed by serve_argv(...)
# Set by the launcher from its own flags; the same flag in --serve-args would contradict it.
RESERVED_SERVE_FLAGS = (
    "--model",
    "--host",
    "--port",
    "--disaggregation-mode",
    "--disaggregation-bootstrap-port",
)
ROUTER_READY_TIMEOUT_S = 60.0  # both servers are up by then: registration takes seconds


def check_serve_args(extra: Sequence[str]) -> None:
    """Raises ValueError if `extra` sets a flag that the launcher (or unit file) decides."""
    for token in extra:
        name = token.split("=", 1)[0]
        if name in RESERVED_SERVE_FLAGS:
            raise ValueError(f"--serve-args must not set {name}: it is set from this command")


def serve_argv(
    role: Role | None,
    model: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    bootstrap_port: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The arguments after the `thermostat` executable for one server (role None: a server
    without disaggregation). The one place deciding the flags a PD server gets, for `thermostat
    pd` and for the unit files of `thermostat systemd`."""
    check_serve_args(extra)
    argv = ["serve", "--model", model, "--host", host, "--port", str(port)]
    if role == "prefill":
        if bootstrap_port is None:
            raise ValueError("a prefill server needs a bootstrap port")
        argv += ["--disaggregation-mode", "prefill"]
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    elif role == "decode":
        argv += ["--disaggregation-mode", "decode"]  # smg tells it the bootstrap per request
    return [*argv, *extra]


@dataclass(frozen=True)
class Plan:
    """What `thermostat pd` runs, every port decided. The router config is the one source of
    the topology: each server listens where its URL there points."""

    model: str
    router: RouterConfig
    smg: str
    log_dir: Path
    serve_args: tuple[str, ...] = ()
    server_cmd: tuple[str, ...] = SERVER_CMD  # runs `serve ...`; tests put a fake server here
    startup_timeout_s: float = 600.0
    stop_grace_s: float = 30.0

    def server(self, role: Role) -> tuple[list[str], str]:
        """The argv and the readiness URL of one server."""
        url = self.router.prefill_url if role == "prefill" else self.router.decode_url
        where = urlsplit(url)
        assert where.hostname is not None and where.port is not None, url
        args = serve_argv(
            role,
            self.model,
            where.port,
            host=where.hostname,
            bootstrap_port=self.router.bootstrap_port,
            extra=self.serve_args,
        )
        return [*self.server_cmd, *args], url + self.router.health_check_endpoint

    @property
    def url(self) -> str:
        return children.local_url(self.router.host, self.router.port)


def launch(plan: Plan, console: Console) -> int:
    """Start, wait, run and stop as the module docstring says; the exit status of `pd`."""
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    servers: list[children.Child] = []
    routers: list[children.Child] = []
    previous_sigterm = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for role in ("prefill", "decode"):
            argv, ready_url = plan.server(role)
            servers.append(children.start(role, argv, ready_url, plan.log_dir))
        with console.status("starting") as status:
            children.wait_ready(
                servers,
                plan.startup_timeout_s,
                on_wait=lambda pending, t: status.update(
                    f"loading the model: {' and '.join(c.name for c in pending)} not ready "
                    f"yet ({t:.0f} s)"
                ),
            )
            status.update("both servers ready; starting smg")
            argv = smg_command(plan.router, plan.smg)
            routers.append(
                children.start("router", argv, plan.url + ROUTER_READY_PATH, plan.log_dir)
            )
            children.wait_ready(routers, ROUTER_READY_TIMEOUT_S, running=servers)
        _print_ready(plan, console)
        gone = children.wait_any_exit([*servers, *routers])
        _print_failure(gone.exit_reason(), gone, console)
        return 1
    except children.LaunchError as exc:
        _print_failure(str(exc), exc.child, console)
        return 1
    except KeyboardInterrupt:
        console.print("stopping: the router first, then both servers")
        return 0
    finally:
        previous_sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a stop is bounded
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        children.stop(routers, plan.stop_grace_s)
        children.stop(servers, plan.stop_grace_s)
        signal.signal(signal.SIGINT, previous_sigint)
        signal.signal(signal.SIGTERM, previous_sigterm)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM stops `pd` the way Ctrl-C does."""
    raise KeyboardInterrupt


def _print_failure(reason: str, child: children.Child, console: Console) -> None:
    console.print(f"[red]error:[/] {reason}; the last lines of {child.log}:")
    console.print(Text.from_ansi(child.tail() or "(empty)"), highlight=False)  # smg colours


def _print_ready(plan: Plan, console: Console) -> None:
    try:
        model = httpx.get(plan.url + "/v1/models", timeout=2.0).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        model = Path(plan.model).name
    r = plan.router
    metrics = children.local_url(r.prometheus_host, r.prometheus_port) + "/metrics"
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}]})
    console.print(f"[green]ready:[/] {plan.url}/v1")
    console.print(  # soft wrap: lines to copy get no inserted line breaks
        f"  prefill {r.prefill_url} (bootstrap port {r.bootstrap_port}), decode {r.decode_url}, "
        f"metrics {metrics}, logs {plan.log_dir}",
        highlight=False,
        soft_wrap=True,
    )
    json_header = "-H 'Content-Type: application/json'"
    curl = f"curl {plan.url}/v1/chat/completions {json_header} -d {shlex.quote(body)}"
    console.print(Text("  " + curl), soft_wrap=True)
    console.print("Ctrl-C stops the router, then both servers.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="model directory, or 'demo' (the default)")
    p.add_argument("--host", default="127.0.0.1", help="the router's address")
    p.add_argument("--port", type=int, default=8000, help="the router's port (clients use it)")
    p.add_argument("--prefill-port", type=int, help="default: a free port")
    p.add_argument("--decode-port", type=int, help="default: a free port")
    p.add_argument("--bootstrap-port", type=int, help="prefill's KV bootstrap; default: free")
    p.add_argument("--prometheus-port", type=int, help="smg's /metrics; default: a free port")
    p.add_argument(
        "--serve-args",
        default="",
        metavar="ARGS",
        help='more `thermostat serve` flags for both, one string: --serve-args="--max-num-seqs 8"',
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds both servers may take to load the model",
    )
    p.add_argument(
        "--stop-grace",
        type=float,
        default=30.0,
        metavar="S",
        help="on stop, seconds each child may take after SIGTERM before SIGKILL",
    )
    p.add_argument("--log-dir", type=Path, help="children's logs (default: a new temporary dir)")
    p.add_argument("--smg", help="the smg executable (default: beside this Python, then PATH)")


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    smg = shutil.which(args.smg) if args.smg else find_smg()
    if smg is None:
        console.print(
            f"[red]error:[/] smg (SGLang's router) is not installed: {SMG_INSTALL_HINT}"
            + (f" (or --smg {args.smg} is not executable)" if args.smg else "")
        )
        return 2
    given = [args.prefill_port, args.decode_port, args.bootstrap_port, args.prometheus_port]
    free = iter(children.free_ports(given.count(None)))
    prefill, decode, bootstrap, prometheus = (p if p is not None else next(free) for p in given)
    try:
        serve_args = tuple(shlex.split(args.serve_args))
        check_serve_args(serve_args)
        if len({args.port, prefill, decode, bootstrap, prometheus}) < 5:
            raise ValueError("the router, prefill, decode, bootstrap and metrics ports must differ")
        router = RouterConfig(
            host=args.host,
            port=args.port,
            prometheus_port=prometheus,
            prefill_url=f"http://127.0.0.1:{prefill}",
            bootstrap_port=bootstrap,
            decode_url=f"http://127.0.0.1:{decode}",
            worker_startup_timeout_secs=max(1, round(args.startup_timeout)),
        )
    except ValueError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="thermostat-pd-"))
    console.print(f"logs: {log_dir}", highlight=False)
    plan = Plan(
        model=args.model,
        router=router,
        smg=smg,
        log_dir=log_dir,
        serve_args=serve_args,
        startup_timeout_s=args.startup_timeout,
        stop_grace_s=args.stop_grace,
    )
    return launch(plan, console)
