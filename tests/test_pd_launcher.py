"""`thermostat pd` and the smg command line: the process management with tiny fake servers
(no model is loaded), and the real smg accepting what `smg_command` builds."""

from __future__ import annotations

import dataclasses
import importlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from tests.waiting import HANG_GUARD_S, wait_until
from thermostat.cli import main
from thermostat.disagg import launcher
from thermostat.disagg.children import (
    Child,
    LaunchError,
    free_ports,
    is_ready,
    start,
    stop,
    wait_ready,
)
from thermostat.disagg.launcher import Plan, serve_argv
from thermostat.disagg.router import FAIL_FAST_FLAGS, RouterConfig, find_smg, smg_command

SMG = find_smg()
needs_smg = pytest.mark.skipif(SMG is None, reason="smg is not installed")

# A stand-in for `thermostat serve`: the argv the launcher builds, the endpoints smg's worker
# registration reads, and on SIGTERM a line saying whether the router still listened.
FAKE_SERVER = r"""
import http.server, json, os, signal, socket, sys, time
args = sys.argv[sys.argv.index("serve") + 1:]
port = int(args[args.index("--port") + 1])
role = args[args.index("--disaggregation-mode") + 1]
print("argv", json.dumps(args), flush=True)
time.sleep(float(os.environ.get("FAKE_DELAY_" + role.upper(), "0")))
await_port = int(os.environ.get("FAKE_AWAIT_" + role.upper(), "0"))  # until that port listens
while await_port:
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", await_port)) == 0:
            break
    time.sleep(0.05)
if "FAKE_EXIT_" + role.upper() in os.environ:
    print("boom: the", role, "model did not load", flush=True)
    sys.exit(int(os.environ["FAKE_EXIT_" + role.upper()]))

def on_sigterm(signum, frame):
    router = int(os.environ.get("FAKE_ROUTER_PORT", "0"))
    with socket.socket() as s:
        up = router > 0 and s.connect_ex(("127.0.0.1", router)) == 0
    print("SIGTERM router_up=%s" % up, flush=True)
    os._exit(0)

signal.signal(signal.SIGTERM, on_sigterm)
ROUTES = {
    "/health": {},
    "/v1/models": {"object": "list", "data": [{"id": "fake-model", "owned_by": "sglang"}]},
    "/server_info": {"disaggregation_mode": role},
    "/model_info": {"model_path": "fake-model"},
}

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ROUTES.get(self.path.split("?")[0])
        data = json.dumps(body if body is not None else {"error": "no"}).encode()
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.fixture
def fake_server(tmp_path: Path) -> Path:
    path = tmp_path / "fake_server.py"
    path.write_text(FAKE_SERVER)
    return path


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def health_child(tmp_path: Path, name: str, gate: Path | None = None) -> Child:
    """A child that serves GET /health with 200; with a `gate`, only once that file exists."""
    (port,) = free_ports(1)
    code = (
        "import http.server, os, time\n"
        f"while {str(gate or '')!r} and not os.path.exists({str(gate or '')!r}):\n"
        "    time.sleep(0.02)\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.send_header('Content-Length', '0')\n"
        "        self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    )
    return start(name, py(code), f"http://127.0.0.1:{port}/health", tmp_path)


def router_config(ports: list[int], **overrides: object) -> RouterConfig:
    router, metrics, prefill, bootstrap, decode = ports
    return RouterConfig(
        port=router,
        prometheus_port=metrics,
        prefill_url=f"http://127.0.0.1:{prefill}",
        bootstrap_port=bootstrap,
        decode_url=f"http://127.0.0.1:{decode}",
        **overrides,  # type: ignore[arg-type]
    )


# --- the serve command line ----------------------------------------------------------------


def test_serve_argv_of_each_role():
    prefill = serve_argv("prefill", "/m", 8100, bootstrap_port=8998, extra=["--max-num-seqs", "8"])
    assert prefill == [
        "serve", "--model", "/m", "--host", "127.0.0.1", "--port", "8100",
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "8998",
        "--max-num-seqs", "8",
    ]  # fmt: skip
    assert serve_argv("decode", "/m", 8200) == [
        "serve", "--model", "/m", "--host", "127.0.0.1", "--port", "8200",
        "--disaggregation-mode", "decode",
    ]  # fmt: skip
    assert "--disaggregation-mode" not in serve_argv(None, "/m", 8000)
    with pytest.raises(ValueError, match="bootstrap"):
        serve_argv("prefill", "/m", 8100)


@pytest.mark.parametrize("flag", ["--port", "--model=x", "--host", "--disaggregation-mode"])
def test_serve_args_cannot_contradict_the_launcher(flag):
    with pytest.raises(ValueError, match=flag.split("=")[0]):
        serve_argv("decode", "/m", 8200, extra=[flag, "1"])


# --- smg_command ---------------------------------------------------------------------------


def test_smg_command_is_pd_on_loopback_and_fails_fast():
    cfg = router_config([8000, 29000, 8100, 8998, 8200])
    argv = smg_command(cfg, "/x/smg")
    assert argv[:2] == ["/x/smg", "launch"]
    pairs = dict(zip(argv, argv[1:], strict=False))
    assert pairs["--host"] == "127.0.0.1" and pairs["--prometheus-host"] == "127.0.0.1"
    assert "--pd-disaggregation" in argv
    i = argv.index("--prefill")
    assert argv[i + 1 : i + 3] == ["http://127.0.0.1:8100", "8998"]
    assert pairs["--decode"] == "http://127.0.0.1:8200"
    for flag, name in FAIL_FAST_FLAGS:
        assert pairs[flag] == str(getattr(cfg, name))
    assert pairs["--retry-max-retries"] == "2"  # smg counts attempts: one retry
    assert pairs["--cb-timeout-duration-secs"] == "2"
    assert pairs["--health-check-interval-secs"] == "1"
    assert pairs["--worker-startup-timeout-secs"] == "600"


def test_router_config_refuses_what_smg_would():
    with pytest.raises(ValueError, match="health_check_interval_secs"):
        router_config([8000, 29000, 8100, 8998, 8200], health_check_interval_secs=0)
    with pytest.raises(ValueError, match="log_level"):
        router_config([8000, 29000, 8100, 8998, 8200], log_level="verbose")


def test_the_docstring_table_states_our_values_and_smgs_defaults():
    """The table in smg_command's docstring is documentation with numbers in it: check them
    against RouterConfig's defaults and, when smg is installed, against smg's own defaults."""
    ours = {f.name: f.default for f in dataclasses.fields(RouterConfig)}
    rows = {}
    for line in (smg_command.__doc__ or "").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0].startswith("--") and cells[0][2:3].isalpha():
            rows[cells[0]] = (cells[1], cells[2])
    assert set(rows) == {flag for flag, _ in FAIL_FAST_FLAGS}
    try:
        RouterArgs = importlib.import_module("smg.router_args").RouterArgs
    except ImportError:
        RouterArgs = None
    for flag, name in FAIL_FAST_FLAGS:
        value, default = rows[flag]
        if value != "same":
            assert value == str(ours[name]), flag
        smg_name = "shutdown_grace_period_secs" if name == "shutdown_grace_secs" else name
        if RouterArgs is not None and default != "same":
            assert default == str(getattr(RouterArgs, smg_name)), flag


@needs_smg
def test_smg_accepts_the_command_and_stays_up_without_workers(tmp_path):
    """The real smg parses every flag (argparse would exit 2 with "usage:"), binds loopback
    and keeps running while the workers are missing; stopped by PID (it renames itself)."""
    assert SMG is not None
    ports = free_ports(5)
    cfg = router_config(ports, worker_startup_timeout_secs=2, shutdown_grace_secs=1)
    proc = subprocess.Popen(
        smg_command(cfg, SMG), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        health = f"http://127.0.0.1:{cfg.port}/health"
        wait_until(lambda: proc.poll() is not None or is_ready(health), "smg answering /health")
        up = proc.poll() is None
        ready = httpx.get(f"http://127.0.0.1:{cfg.port}/readiness", timeout=2) if up else None
        time.sleep(3)  # past the worker startup timeout: still up
        alive = proc.poll() is None
    finally:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert "usage:" not in err and proc.returncode != 2, err[-2000:]
    assert up and alive, err[-2000:]
    assert ready is not None and ready.status_code == 503  # no healthy worker pair


# --- the process management -----------------------------------------------------------------


def test_wait_ready_returns_once_all_answer_and_reports_who_is_pending(tmp_path):
    """ "slow" answers only after wait_ready has reported it pending alone: the order is made by
    the test, not by a sleep in the child."""
    gate = tmp_path / "slow.gate"
    fast, slow = health_child(tmp_path, "fast"), health_child(tmp_path, "slow", gate=gate)
    seen: list[list[str]] = []

    def on_wait(pending: list[Child], elapsed_s: float) -> None:
        seen.append([c.name for c in pending])
        if seen[-1] == ["slow"]:
            gate.touch()

    try:
        wait_ready([fast, slow], timeout_s=HANG_GUARD_S, on_wait=on_wait)
    finally:
        stop([fast, slow], grace_s=5)
    assert seen and seen[-1] == ["slow"]
    assert all(names in (["fast", "slow"], ["slow"]) for names in seen), seen


def test_wait_ready_reports_a_child_that_exits_with_its_log(tmp_path):
    child = start(
        "decode",
        py("print('boom: no model'); raise SystemExit(3)"),
        "http://127.0.0.1:9/",
        tmp_path,
    )
    with pytest.raises(LaunchError, match="decode exited with status 3") as info:
        wait_ready([child], timeout_s=HANG_GUARD_S)
    assert info.value.child is child
    assert "boom: no model" in child.tail()


def test_wait_ready_watches_the_running_children_too(tmp_path):
    waiting = start("router", py("import time; time.sleep(30)"), "http://127.0.0.1:9/", tmp_path)
    running = start("prefill", py("raise SystemExit(1)"), "http://127.0.0.1:9/", tmp_path)
    try:
        with pytest.raises(LaunchError, match="prefill exited with status 1"):
            wait_ready([waiting], timeout_s=HANG_GUARD_S, running=[running])
    finally:
        stop([waiting], grace_s=5)


def test_wait_ready_is_bounded(tmp_path):
    """It gives up on a child that never answers while that child still runs: bounded by its
    timeout, not by the child's life."""
    child = start("decode", py("import time; time.sleep(600)"), "http://127.0.0.1:9/", tmp_path)
    try:
        with pytest.raises(LaunchError, match="decode not ready after"):
            wait_ready([child], timeout_s=0.5)
        assert child.proc.poll() is None
    finally:
        stop([child], grace_s=5)


def test_stop_sends_sigterm_then_kills_the_process_group(tmp_path):
    polite = start("polite", py("import time; time.sleep(30)"), "http://127.0.0.1:9/", tmp_path)
    stubborn_code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "print(g.pid, flush=True)\n"
        "time.sleep(30)\n"
    )
    stubborn = start("stubborn", py(stubborn_code), "http://127.0.0.1:9/", tmp_path)
    wait_until(lambda: stubborn.tail().strip() != "", "the grandchild's pid in the log")
    grandchild = int(stubborn.tail().strip())
    stop([polite, stubborn], grace_s=0.5)
    # Both would run 30 s: these exit statuses say stop ended them, and how.
    assert polite.proc.returncode == -signal.SIGTERM
    assert stubborn.proc.returncode == -signal.SIGKILL
    assert stubborn.exit_reason() == "stubborn was killed by SIGKILL"
    wait_until(lambda: not _running(grandchild), "the grandchild to end after the group's SIGKILL")


def _running(pid: int) -> bool:
    """Running (a zombie waiting for a reaper does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# --- launch, end to end with fake servers ----------------------------------------------------


def test_a_server_that_fails_to_load_stops_everything_with_its_log(
    tmp_path, fake_server, monkeypatch
):
    ports = free_ports(5)
    monkeypatch.setenv("FAKE_EXIT_DECODE", "3")
    # decode fails once prefill listens, so prefill traps SIGTERM by then
    monkeypatch.setenv("FAKE_AWAIT_DECODE", str(ports[2]))
    sigterm_before = signal.getsignal(signal.SIGTERM)
    plan = Plan(
        model="/models/m",
        router=router_config(ports),
        smg="/bin/false",  # never started: decode fails first
        log_dir=tmp_path / "logs",
        server_cmd=(sys.executable, str(fake_server)),
        startup_timeout_s=HANG_GUARD_S,
        stop_grace_s=5,
    )
    out = io.StringIO()
    assert launcher.launch(plan, Console(file=out, width=200)) == 1
    assert "decode exited with status 3" in out.getvalue()
    assert "boom: the decode model did not load" in out.getvalue()
    assert "SIGTERM" in (tmp_path / "logs" / "prefill.log").read_text()  # stopped, not left
    assert not (tmp_path / "logs" / "router.log").exists()
    assert signal.getsignal(signal.SIGTERM) == sigterm_before  # restored


@needs_smg
def test_launch_serves_through_smg_and_stops_the_router_first(tmp_path, fake_server):
    """Fake servers, the real smg: `pd` gets ready, answers through the router, and on SIGTERM
    stops smg before either server (each server checks, when its SIGTERM comes, whether the
    router still listens) and exits 0."""
    ports = free_ports(5)
    cfg = dict(
        port=ports[0],
        prometheus_port=ports[1],
        prefill_url=f"http://127.0.0.1:{ports[2]}",
        bootstrap_port=ports[3],
        decode_url=f"http://127.0.0.1:{ports[4]}",
        shutdown_grace_secs=1,
    )
    driver = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from rich.console import Console\n"
        "from thermostat.disagg.launcher import Plan, launch\n"
        "from thermostat.disagg.router import RouterConfig\n"
        "p = json.loads(sys.argv[1])\n"
        "plan = Plan(model='/models/m', router=RouterConfig(**p['router']), smg=p['smg'],\n"
        "    log_dir=Path(p['log_dir']), server_cmd=(sys.executable, p['fake']),\n"
        "    serve_args=('--max-num-seqs', '8'), startup_timeout_s=p['guard'], stop_grace_s=10)\n"
        "sys.exit(launch(plan, Console(stderr=True, width=300)))\n"
    )
    params = {
        "router": cfg,
        "smg": SMG,
        "log_dir": str(tmp_path / "logs"),
        "fake": str(fake_server),
        "guard": HANG_GUARD_S,
    }
    env = {**os.environ, "FAKE_ROUTER_PORT": str(ports[0]), "FAKE_DELAY_DECODE": "0.5"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(launcher.__file__).parents[2]), env.get("PYTHONPATH", "")]
    )
    stderr = tmp_path / "pd.err"
    with stderr.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", driver, json.dumps(params)],
            stdout=subprocess.DEVNULL,
            stderr=out,
            text=True,
            env=env,
        )
    url = f"http://127.0.0.1:{ports[0]}"
    try:
        # the last of the ready lines: everything is up and said so
        wait_until(
            lambda: "Ctrl-C stops" in stderr.read_text() or proc.poll() is not None,
            "`pd` saying it is ready",
        )
        models = None
        if proc.poll() is None:
            models = httpx.get(f"{url}/v1/models", timeout=60).json()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = stderr.read_text()
    assert models is not None, err[-3000:]
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    assert proc.returncode == 0, err[-3000:]
    assert f"ready: {url}/v1" in err and "fake-model" in err  # the curl example names it
    logs = tmp_path / "logs"
    for role in ("prefill", "decode"):
        text = (logs / f"{role}.log").read_text()
        assert "SIGTERM router_up=False" in text, text  # the router was already gone
        argv = json.loads(text.splitlines()[0].removeprefix("argv "))
        assert argv[argv.index("--disaggregation-mode") + 1] == role
        assert argv[-2:] == ["--max-num-seqs", "8"]
    prefill_argv = json.loads((logs / "prefill.log").read_text().splitlines()[0][5:])
    assert prefill_argv[prefill_argv.index("--disaggregation-bootstrap-port") + 1] == str(ports[3])
    assert (logs / "router.log").exists()


# --- the command ---------------------------------------------------------------------------


def test_pd_without_smg_is_exit_2_naming_the_package(monkeypatch, capsys):
    monkeypatch.setattr(launcher, "find_smg", lambda: None)
    assert main(["pd"]) == 2
    assert "pip install smg==1.13.0" in capsys.readouterr().err
    assert main(["pd", "--smg", "/nonexistent/smg"]) == 2
    assert "/nonexistent/smg" in capsys.readouterr().err


def test_pd_refuses_serve_args_that_contradict_it(capsys):
    assert main(["pd", "--smg", sys.executable, "--serve-args=--port 1"]) == 2
    assert "--port" in capsys.readouterr().err
