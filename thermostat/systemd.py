"""systemd: the unit files of `thermostat systemd`, and `notify` for `thermostat serve`.

| unit (prefix thermostat)   | runs                     | Type   | ties                           |
|----------------------------|--------------------------|--------|--------------------------------|
| thermostat.service         | single mode: one server  | notify | WantedBy the default target    |
| thermostat-prefill.service | the prefill server       | notify | PartOf, WantedBy the target    |
| thermostat-decode.service  | the decode server        | notify | PartOf, WantedBy the target    |
| thermostat-router.service  | smg (`smg_command`)      | simple | After and Wants both servers   |
| thermostat.target          | nothing: groups the rest | -      | Wants the three                |

Type=notify makes "started" mean "the model is loaded": the server sends READY=1 through
`notify` then, so the router, ordered After= both servers, starts only once both can serve. A
restart of the target stops the router first (the reverse of After=) and starts it last. The
router Wants= the servers rather than Requires= them: a server restarting on its own leaves the
router up, answering 503 fast, and smg's health checks take the server back within seconds.
Servers drain on SIGTERM, so TimeoutStopSec is their --drain-timeout plus a margin.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import shutil
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rich.console import Console

from thermostat.disagg.launcher import serve_argv
from thermostat.disagg.router import SMG_INSTALL_HINT, RouterConfig, find_smg, smg_command

logger = logging.getLogger(__name__)

HELP = "write systemd unit files: one server, or prefill + decode + smg router"
EPILOG = """examples:
  thermostat systemd --model ~/models/Qwen3-0.6B --out ./units --user
  thermostat systemd --mode pd --model ~/models/Qwen3-0.6B --out ./units --user
  thermostat systemd --mode pd --model DIR --out ./units --router-port 9000 \\
      --serve-args "--sampling-defaults recommended --drain-timeout 120"

It prints the commands to install, start, restart and watch the units. In pd mode prefill and
decode listen on 127.0.0.1; --host and --router-port are what clients use.

exit status: 0 files written, 2 bad flags, a missing model directory or executable.
"""

STOP_MARGIN_S = 30  # TimeoutStopSec beyond a server's drain (or the router's grace period)
UNIT_PREFIX = re.compile(r"[A-Za-z0-9_.:-]+")
_BARE_WORD = re.compile(r"[^\s\"'\\;]+")  # systemd takes these unquoted and unescaped


@dataclass(frozen=True)
class UnitsConfig:
    """What the unit files run. Paths are absolute (`model` may be 'demo')."""

    mode: Literal["single", "pd"]
    model: str
    thermostat: str
    smg: str | None = None  # required in pd mode
    user: bool = False  # user units (systemctl --user) rather than system units
    prefix: str = "thermostat"
    host: str = "127.0.0.1"  # what clients reach: the server (single) or the router (pd)
    port: int = 8000  # single mode: the server
    router_port: int = 8000  # pd mode: the router
    prefill_port: int = 8100
    decode_port: int = 8200
    bootstrap_port: int = 8998
    prometheus_port: int = 29000  # smg's /metrics, on 127.0.0.1
    serve_args: tuple[str, ...] = ()
    start_timeout_s: int = 600  # a model load: TimeoutStartSec, and smg's worker startup wait
    drain_timeout_s: float = 60.0  # the servers' --drain-timeout (see serve_drain_timeout)

    def unit(self, role: str | None = None, suffix: str = "service") -> str:
        return f"{self.prefix}{'-' + role if role else ''}.{suffix}"

    @property
    def install_target(self) -> str:
        return "default.target" if self.user else "multi-user.target"

    def router_config(self) -> RouterConfig:
        return RouterConfig(
            host=self.host,
            port=self.router_port,
            prometheus_port=self.prometheus_port,
            prefill_url=f"http://127.0.0.1:{self.prefill_port}",
            bootstrap_port=self.bootstrap_port,
            decode_url=f"http://127.0.0.1:{self.decode_port}",
            worker_startup_timeout_secs=self.start_timeout_s,
        )


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
        logger.warning("sd_notify to %r failed: %s", os.environ.get("NOTIFY_SOCKET"), exc)
        return False
    return True


def systemd_quote(word: str) -> str:
    """One argv word as systemd's ExecStart= reads it back: `%` and `$` doubled (specifiers
    and variables expand even inside quotes), anything else unusual inside double quotes with
    C escapes."""
    word = word.replace("%", "%%").replace("$", "$$")
    if _BARE_WORD.fullmatch(word):
        return word
    escaped = word.replace("\\", "\\\\").replace('"', '\\"')
    escaped = escaped.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    return f'"{escaped}"'


def exec_line(argv: Sequence[str]) -> str:
    return " ".join(systemd_quote(word) for word in argv)


def serve_drain_timeout(serve_args: Sequence[str]) -> float:
    """The --drain-timeout that `thermostat serve` will use with `serve_args`. Raises
    ValueError naming a flag serve does not know or a bad value, so a typo fails now rather
    than at the unit's start."""
    # Imported here, not at the top: `thermostat serve` imports `notify` from this module.
    from thermostat.server import command as serve_command

    parser = argparse.ArgumentParser(prog="thermostat serve", add_help=False, exit_on_error=False)
    serve_command.add_arguments(parser)
    try:
        options, unknown = parser.parse_known_args(list(serve_args))
    except argparse.ArgumentError as exc:
        raise ValueError(f"--serve-args: {exc}") from None
    if unknown:
        raise ValueError(f"--serve-args: thermostat serve has no {' '.join(unknown)}")
    return float(options.drain_timeout)


def render_units(cfg: UnitsConfig) -> dict[str, str]:
    """File name -> text of each unit file. Pure."""
    if cfg.mode == "single":
        argv = serve_argv(None, cfg.model, cfg.port, host=cfg.host, extra=cfg.serve_args)
        unit = _server_unit(cfg, "Thermostat server", argv, group=None)
        return {cfg.unit(): unit}
    if cfg.smg is None:
        raise ValueError(f"pd mode needs smg: {SMG_INSTALL_HINT}")
    target = cfg.unit(suffix="target")
    prefill, decode, router = cfg.unit("prefill"), cfg.unit("decode"), cfg.unit("router")
    prefill_argv = serve_argv(
        "prefill",
        cfg.model,
        cfg.prefill_port,
        bootstrap_port=cfg.bootstrap_port,
        extra=cfg.serve_args,
    )
    decode_argv = serve_argv("decode", cfg.model, cfg.decode_port, extra=cfg.serve_args)
    router_cfg = cfg.router_config()
    servers = f"{prefill} {decode}"
    router_unit = {
        "Unit": [
            ("Description", "Thermostat router (smg) in front of prefill and decode"),
            ("After", servers),
            ("Wants", servers),
            ("PartOf", target),
        ],
        "Service": [
            ("Type", "simple"),
            ("ExecStart", exec_line(smg_command(router_cfg, cfg.smg))),
            ("Restart", "on-failure"),
            ("RestartSec", "2"),
            ("KillSignal", "SIGTERM"),
            ("TimeoutStopSec", str(router_cfg.shutdown_grace_secs + STOP_MARGIN_S)),
        ],
        "Install": [("WantedBy", target)],
    }
    target_unit = {
        "Unit": [
            ("Description", "Thermostat prefill/decode: both servers and the router"),
            ("Wants", f"{servers} {router}"),
        ],
        "Install": [("WantedBy", cfg.install_target)],
    }
    return {
        prefill: _server_unit(cfg, "Thermostat prefill server", prefill_argv, group=target),
        decode: _server_unit(cfg, "Thermostat decode server", decode_argv, group=target),
        router: _unit_text(router_unit),
        target: _unit_text(target_unit),
    }


def write_units(cfg: UnitsConfig, out_dir: Path) -> list[Path]:
    units = render_units(cfg)  # raises before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in units.items():
        path = out_dir / name
        path.write_text(text)
        paths.append(path)
    return paths


def _server_unit(cfg: UnitsConfig, description: str, argv: list[str], group: str | None) -> str:
    model = "the demo model" if cfg.model == "demo" else Path(cfg.model).name
    unit = [("Description", f"{description}, {_escape_specifiers(model)}")]
    unit += [("After", "network.target")]
    if group is not None:
        unit.append(("PartOf", group))
    service = [
        ("Type", "notify"),  # READY=1 once the model is loaded, STOPPING=1 on drain
        ("NotifyAccess", "main"),
        ("ExecStart", exec_line([cfg.thermostat, *argv])),
        ("Environment", "PYTHONUNBUFFERED=1"),
        ("Restart", "on-failure"),
        ("RestartSec", "2"),
        ("TimeoutStartSec", str(cfg.start_timeout_s)),
        ("KillSignal", "SIGTERM"),  # the server drains in-flight requests, then exits 0
        ("TimeoutStopSec", str(round(cfg.drain_timeout_s) + STOP_MARGIN_S)),
    ]
    install = [("WantedBy", group or cfg.install_target)]
    return _unit_text({"Unit": unit, "Service": service, "Install": install})


def _unit_text(sections: dict[str, list[tuple[str, str]]]) -> str:
    lines = ["# Written by `thermostat systemd`: regenerate it rather than edit it."]
    for name, items in sections.items():
        lines += ["", f"[{name}]", *(f"{key}={value}" for key, value in items)]
    return "\n".join(lines) + "\n"


def _escape_specifiers(text: str) -> str:
    return text.replace("%", "%%")


def _absolute_executable(cmd: str | None) -> str | None:
    """`cmd` (a path, or a name on PATH) as an absolute path, if it is an executable."""
    found = shutil.which(cmd) if cmd else None
    return os.path.abspath(found) if found else None


def _beside_python(name: str) -> str | None:
    """`name` installed beside this Python (its virtual environment), if there."""
    path = Path(sys.executable).with_name(name)  # not resolved: a venv's python is a link
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["single", "pd"], default="single")
    p.add_argument("--model", required=True, help="model directory, or 'demo'")
    p.add_argument("--out", type=Path, required=True, help="where to write the unit files")
    p.add_argument("--user", action="store_true", help="user units: systemctl --user")
    p.add_argument("--prefix", default="thermostat", help="unit names start with it")
    p.add_argument("--host", default="127.0.0.1", help="the server's (pd: the router's) address")
    p.add_argument("--port", type=int, default=8000, help="single mode: the server's port")
    p.add_argument("--router-port", type=int, default=8000, help="pd mode: the router's port")
    p.add_argument("--prefill-port", type=int, default=8100)
    p.add_argument("--decode-port", type=int, default=8200)
    p.add_argument("--bootstrap-port", type=int, default=8998)
    p.add_argument("--prometheus-port", type=int, default=29000, help="smg's /metrics")
    p.add_argument(
        "--serve-args",
        default="",
        metavar="ARGS",
        help='more `thermostat serve` flags, one string: --serve-args="--max-num-seqs 32"',
    )
    p.add_argument(
        "--start-timeout",
        type=int,
        default=600,
        metavar="S",
        help="seconds a server may take to load the model (TimeoutStartSec)",
    )
    p.add_argument("--thermostat", help="the thermostat executable (default: beside Python)")
    p.add_argument("--smg", help="the smg executable (default: beside Python, then PATH)")


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        cfg = _config_from(args)
        paths = write_units(cfg, args.out.resolve())
    except ValueError as exc:
        console.print(f"[red]error:[/] {exc}", highlight=False)
        return 2
    _print_instructions(cfg, paths)
    return 0


def _config_from(args: argparse.Namespace) -> UnitsConfig:
    """Raises ValueError naming what is wrong."""
    if not UNIT_PREFIX.fullmatch(args.prefix):
        raise ValueError(f"--prefix {args.prefix!r}: use letters, digits and _.:-")
    model = args.model
    if model != "demo":
        path = Path(model).expanduser().resolve()
        if not path.is_dir():
            raise ValueError(f"--model {model}: not a directory")
        model = str(path)
    thermostat = _absolute_executable(
        args.thermostat or _beside_python("thermostat") or "thermostat"
    )
    if thermostat is None:
        given = f" {args.thermostat}" if args.thermostat else ""
        raise ValueError(f"cannot find the thermostat executable{given}: give --thermostat PATH")
    smg = None
    if args.mode == "pd":
        smg = _absolute_executable(args.smg or find_smg())
        if smg is None:
            raise ValueError(f"smg (SGLang's router) is not installed: {SMG_INSTALL_HINT}")
        ports = [args.router_port, args.prefill_port, args.decode_port]
        if len({*ports, args.bootstrap_port, args.prometheus_port}) < 5:
            raise ValueError("the router, prefill, decode, bootstrap and metrics ports must differ")
    serve_args = tuple(shlex.split(args.serve_args))
    return UnitsConfig(
        mode=args.mode,
        model=model,
        thermostat=thermostat,
        smg=smg,
        user=args.user,
        prefix=args.prefix,
        host=args.host,
        port=args.port,
        router_port=args.router_port,
        prefill_port=args.prefill_port,
        decode_port=args.decode_port,
        bootstrap_port=args.bootstrap_port,
        prometheus_port=args.prometheus_port,
        serve_args=serve_args,
        start_timeout_s=args.start_timeout,
        drain_timeout_s=serve_drain_timeout(serve_args),
    )


def _print_instructions(cfg: UnitsConfig, paths: list[Path]) -> None:
    """Plain print, not rich: the commands are to be copied, so no line may wrap."""
    user = " --user" if cfg.user else ""
    sudo = "" if cfg.user else "sudo "
    unit_dir = "~/.config/systemd/user" if cfg.user else "/etc/systemd/system"
    main = cfg.unit() if cfg.mode == "single" else cfg.unit(suffix="target")
    watched = cfg.unit() if cfg.mode == "single" else cfg.unit("decode")
    files = " ".join(shlex.quote(str(p)) for p in paths)
    what = "the server" if cfg.mode == "single" else "both servers and the router in one step"
    lines = [
        f"wrote {len(paths)} unit file{'s' if len(paths) > 1 else ''}:",
        *(f"  {path}" for path in paths),
        "install and start:",
        f"  {sudo}mkdir -p {unit_dir} && {sudo}cp {files} {unit_dir}/",
        f"  {sudo}systemctl{user} daemon-reload",
        f"  {sudo}systemctl{user} enable --now {main}",
        f"restart {what}:",
        f"  {sudo}systemctl{user} restart {main}",
        "watch the model load and the server report ready:",
        f"  journalctl{user} -u {watched.removesuffix('.service')} -f",
    ]
    if cfg.user:
        lines.append("user units stop at logout unless: loginctl enable-linger $USER")
    print("\n".join(lines))
