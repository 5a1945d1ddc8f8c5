"""`thermostat systemd`: the flags, the checks on them, and the commands printed to install the
unit files (thermostat.systemd renders them)."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from thermostat.disagg.router import SMG_INSTALL_HINT, find_smg
from thermostat.server import command as serve_command
from thermostat.systemd import UnitsConfig, write_units

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

UNIT_PREFIX = re.compile(r"[A-Za-z0-9_.:-]+")


def serve_drain_timeout(serve_args: Sequence[str]) -> float:
    """The --drain-timeout that `thermostat serve` will use with `serve_args`. Raises
    ValueError naming a flag serve does not know or a bad value, so a typo fails now rather
    than at the unit's start."""
    parser = argparse.ArgumentParser(prog="thermostat serve", add_help=False, exit_on_error=False)
    serve_command.add_arguments(parser)
    try:
        options, unknown = parser.parse_known_args(list(serve_args))
    except argparse.ArgumentError as exc:
        raise ValueError(f"--serve-args: {exc}") from None
    if unknown:
        raise ValueError(f"--serve-args: thermostat serve has no {' '.join(unknown)}")
    return float(options.drain_timeout)


def _absolute_executable(cmd: str | None) -> str | None:
    """`cmd` (a path, or a name on PATH) as an absolute path, if it is an executable."""
    found = shutil.which(cmd) if cmd else None
    return os.path.abspath(found) if found else None


def _beside_python(name: str) -> str | None:
    """`name` installed beside this Python (its virtual environment), if there."""
    path = Path(sys.executable).with_name(name)  # not resolved: a venv's python is a link
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        choices=["single", "pd"],
        default="single",
        help="single: one server; pd: prefill and decode servers behind smg",
    )
    p.add_argument("--model", required=True, help="model directory, or 'demo'")
    p.add_argument("--out", type=Path, required=True, help="where to write the unit files")
    p.add_argument("--user", action="store_true", help="user units: systemctl --user")
    p.add_argument("--prefix", default="thermostat", help="unit names start with it")
    p.add_argument("--host", default="127.0.0.1", help="the server's (pd: the router's) address")
    p.add_argument("--port", type=int, default=8000, help="single mode: the server's port")
    p.add_argument("--router-port", type=int, default=8000, help="pd mode: the router's port")
    p.add_argument("--prefill-port", type=int, default=8100, help="pd mode: the prefill server's")
    p.add_argument("--decode-port", type=int, default=8200, help="pd mode: the decode server's")
    p.add_argument(
        "--bootstrap-port", type=int, default=8998, help="pd mode: the prefill's KV bootstrap"
    )
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
        if not path.is_dir() and not (path.is_file() and path.suffix == ".gguf"):
            raise ValueError(f"--model {model}: not a directory (or a .gguf file)")
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
