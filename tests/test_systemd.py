"""`thermostat systemd` unit files, their ExecStart quoting, and `notify` (sd_notify, in
thermostat.api.lifecycle)."""

from __future__ import annotations

import configparser
import logging
import shlex
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from thermostat.api.lifecycle import notify
from thermostat.cli import main
from thermostat.disagg.launcher import serve_argv
from thermostat.disagg.router import smg_command
from thermostat.systemd import UnitsConfig, render_units, systemd_quote, write_units

# An executable that exists, for the units' binaries: systemd-analyze verify checks them.
EXE = sys.executable
WEIRD_NAME = 'say "hi" to $USER at 100% \\o/'  # quotes, a variable, a specifier, a backslash


def unquote(line: str) -> list[str]:
    """An ExecStart= line back to argv, as systemd reads it: shell-like words in double quotes
    (shlex agrees with systemd on \\\\ and \\" there), then `%%` and `$$` undoubled."""
    return [w.replace("%%", "%").replace("$$", "$") for w in shlex.split(line)]


def parse(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment, method-assign]  # keys keep their case
    parser.read_string(text)
    return parser


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "my model%1"  # a space and a specifier character
    path.mkdir()
    return path


def pd_config(model_dir: Path, **overrides: object) -> UnitsConfig:
    options: dict[str, object] = dict(
        mode="pd",
        model=str(model_dir),
        thermostat=EXE,
        smg=EXE,
        serve_args=("--served-model-name", WEIRD_NAME),
    )
    return UnitsConfig(**(options | overrides))  # type: ignore[arg-type]


def test_pd_units_have_every_key_and_the_order(model_dir):
    cfg = pd_config(model_dir)
    units = {name: parse(text) for name, text in render_units(cfg).items()}
    assert set(units) == {
        "thermostat-prefill.service",
        "thermostat-decode.service",
        "thermostat-router.service",
        "thermostat.target",
    }
    for role in ("prefill", "decode"):
        unit = units[f"thermostat-{role}.service"]
        assert unit["Unit"]["PartOf"] == "thermostat.target"
        service = unit["Service"]
        assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
        assert service["Restart"] == "on-failure" and service["RestartSec"] == "2"
        assert service["KillSignal"] == "SIGTERM"
        assert int(service["TimeoutStartSec"]) >= 600  # a model load
        assert int(service["TimeoutStopSec"]) > 60  # beyond serve's default --drain-timeout
        assert unit["Install"]["WantedBy"] == "thermostat.target"
        argv = unquote(service["ExecStart"])
        assert argv[0] == EXE and Path(argv[0]).is_absolute()
        assert argv[argv.index("--model") + 1] == str(model_dir)
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert argv[argv.index("--disaggregation-mode") + 1] == role
        assert argv[argv.index("--served-model-name") + 1] == WEIRD_NAME
    prefill = unquote(units["thermostat-prefill.service"]["Service"]["ExecStart"])
    assert prefill[1:] == serve_argv(
        "prefill", str(model_dir), 8100, bootstrap_port=8998, extra=cfg.serve_args
    )
    assert "--disaggregation-bootstrap-port" not in unquote(
        units["thermostat-decode.service"]["Service"]["ExecStart"]
    )

    router = units["thermostat-router.service"]
    servers = {"thermostat-prefill.service", "thermostat-decode.service"}
    assert set(router["Unit"]["After"].split()) == servers  # the router starts after both
    assert set(router["Unit"]["Wants"].split()) == servers
    assert router["Unit"]["PartOf"] == "thermostat.target"
    assert router["Service"]["Type"] == "simple"
    assert router["Service"]["Restart"] == "on-failure"
    router_argv = unquote(router["Service"]["ExecStart"])
    assert router_argv == smg_command(cfg.router_config(), EXE)
    assert router_argv[router_argv.index("--host") + 1] == "127.0.0.1"
    assert router_argv[router_argv.index("--prometheus-host") + 1] == "127.0.0.1"
    assert router["Install"]["WantedBy"] == "thermostat.target"

    target = units["thermostat.target"]
    assert set(target["Unit"]["Wants"].split()) == servers | {"thermostat-router.service"}
    assert target["Install"]["WantedBy"] == "multi-user.target"


def test_user_units_prefix_ports_host_and_drain(model_dir):
    cfg = pd_config(
        model_dir,
        user=True,
        prefix="tst",
        host="0.0.0.0",
        router_port=9000,
        prefill_port=9100,
        decode_port=9200,
        bootstrap_port=9300,
        drain_timeout_s=100.0,
    )
    units = {name: parse(text) for name, text in render_units(cfg).items()}
    assert units["tst.target"]["Install"]["WantedBy"] == "default.target"
    assert units["tst-decode.service"]["Unit"]["PartOf"] == "tst.target"
    assert units["tst-decode.service"]["Service"]["TimeoutStopSec"] == "130"
    router = unquote(units["tst-router.service"]["Service"]["ExecStart"])
    assert router[router.index("--host") + 1] == "0.0.0.0"  # the operator said so
    assert router[router.index("--prometheus-host") + 1] == "127.0.0.1"  # metrics stay local
    assert router[router.index("--prefill") + 1 : router.index("--prefill") + 3] == [
        "http://127.0.0.1:9100",
        "9300",
    ]
    decode = unquote(units["tst-decode.service"]["Service"]["ExecStart"])
    assert decode[decode.index("--host") + 1] == "127.0.0.1"  # servers stay on loopback


def test_single_unit(model_dir):
    cfg = UnitsConfig(mode="single", model=str(model_dir), thermostat=EXE, port=8001)
    (name, text), *rest = render_units(cfg).items()
    assert name == "thermostat.service" and not rest
    unit = parse(text)
    assert "PartOf" not in unit["Unit"]
    assert unit["Service"]["Type"] == "notify"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    argv = unquote(unit["Service"]["ExecStart"])
    assert argv == [EXE, *serve_argv(None, str(model_dir), 8001)]


@pytest.mark.parametrize(
    "word",
    ["plain", "", "a b", "100%", "$HOME", "${X}", 'say "hi"', "back\\slash", "it's", "a;b", ";"],
)
def test_systemd_quote_round_trips(word):
    line = " ".join(["/bin/x", systemd_quote(word), "--flag"])
    assert unquote(line) == ["/bin/x", word, "--flag"]


def test_systemd_quote_leaves_plain_words_bare():
    assert systemd_quote("/usr/bin/thermostat") == "/usr/bin/thermostat"
    assert systemd_quote("a b") == '"a b"'
    assert systemd_quote("50%") == "50%%"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
@pytest.mark.parametrize("mode", ["single", "pd"])
def test_systemd_analyze_verify_accepts_the_units(model_dir, tmp_path, mode):
    paths = write_units(pd_config(model_dir, mode=mode), tmp_path / "units")
    result = subprocess.run(
        ["systemd-analyze", "verify", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    ours = [line for line in result.stderr.splitlines() if any(p.name in line for p in paths)]
    assert result.returncode == 0 and not ours, result.stderr


def test_command_writes_units_and_prints_how_to_run_them(model_dir, tmp_path, capsys):
    out = tmp_path / "units"
    args = ["systemd", "--mode", "pd", "--model", str(model_dir), "--out", str(out), "--user"]
    assert main([*args, "--thermostat", EXE, "--smg", EXE]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [
        "thermostat-decode.service",
        "thermostat-prefill.service",
        "thermostat-router.service",
        "thermostat.target",
    ]
    assert "systemctl --user daemon-reload" in printed
    assert "systemctl --user restart thermostat.target" in printed
    assert "journalctl --user -u thermostat-decode -f" in printed
    assert str(out / "thermostat.target") in printed


def test_command_reads_the_drain_timeout_from_serve_args(model_dir, tmp_path):
    out = tmp_path / "units"
    args = ["systemd", "--model", str(model_dir), "--out", str(out), "--thermostat", EXE]
    assert main([*args, "--serve-args=--drain-timeout 100 --max-num-seqs 8"]) == 0
    service = parse((out / "thermostat.service").read_text())["Service"]
    assert service["TimeoutStopSec"] == "130"
    assert unquote(service["ExecStart"])[-4:] == ["--drain-timeout", "100", "--max-num-seqs", "8"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "/nonexistent/model"], "not a directory"),
        (["--serve-args=--port 9"], "--port"),
        (["--serve-args=--drain-timout 9"], "--drain-timout"),
        (["--serve-args=--drain-timeout soon"], "invalid float"),
        (["--prefix", "bad name"], "--prefix"),
        (["--mode", "pd", "--router-port", "8100"], "must differ"),
        (["--thermostat", "/nonexistent/thermostat"], "thermostat executable"),
    ],
)
def test_command_refuses_bad_flags_and_writes_nothing(model_dir, tmp_path, capsys, extra, message):
    out = tmp_path / "units"
    args = ["systemd", "--model", str(model_dir), "--out", str(out), "--smg", EXE]
    assert main([*args, "--thermostat", EXE, *extra]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


# --- notify ----------------------------------------------------------------------------------


def test_notify_sends_the_state_to_notify_socket(tmp_path, monkeypatch):
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert notify("READY=1\nSTATUS=model loaded") is True
        assert sock.recv(4096) == b"READY=1\nSTATUS=model loaded"


def test_notify_abstract_namespace(monkeypatch):
    name = f"thermostat-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify("STOPPING=1") is True
        assert sock.recv(4096) == b"STOPPING=1"


def test_notify_without_systemd_is_false(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False


def test_notify_to_a_missing_socket_warns_and_returns_false(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    with caplog.at_level(logging.WARNING, logger="thermostat.server"):
        assert notify("READY=1") is False
    assert "gone.sock" in caplog.text
