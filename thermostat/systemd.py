"""systemd: the unit files `thermostat systemd` writes (thermostat.commands.systemd); the
servers report readiness with `thermostat.api.lifecycle.notify`.

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

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from thermostat.disagg.launcher import serve_argv
from thermostat.disagg.router import SMG_INSTALL_HINT, RouterConfig, smg_command

STOP_MARGIN_S = 30  # TimeoutStopSec beyond a server's drain (or the router's grace period)
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
    for name, text in units.items():
        (out_dir / name).write_text(text)
    return [out_dir / name for name in units]


def _server_unit(cfg: UnitsConfig, description: str, argv: list[str], group: str | None) -> str:
    model = "the demo model" if cfg.model == "demo" else Path(cfg.model).name
    unit = [("Description", f"{description}, {model.replace('%', '%%')}")]  # % starts a specifier
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
