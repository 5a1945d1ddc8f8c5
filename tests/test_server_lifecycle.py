"""The real command line: `python -m thermostat.cli serve` in a subprocess. It reports its
sampling defaults, says where it listens when ready (and tells systemd: READY=1), and on SIGTERM
finishes the request in flight before it exits."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import write_model

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_reports_drains_on_sigterm_and_exits(tmp_path):
    model = write_model(tmp_path / "model", "llama", generation_config={"do_sample": False})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # systemd's Type=notify socket
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(30)
    env = dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "notify.sock"))
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "thermostat.cli",
                "serve",
                "--model",
                str(model),
                "--port",
                str(port),
                "--kv-cache-memory-gb",
                "0.004",
                "--dtype",
                "float32",
            ],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 120
        ready = False
        while not ready and time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                time.sleep(0.2)
        assert ready, log_path.read_text()
        assert notify.recv(4096).decode().startswith("READY=1\nSTATUS=serving")

        body = {"prompt": "It was", "max_tokens": 400, "ignore_eos": True, "stream": True}
        events, signalled, after = [], False, None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: ") :])
                if not signalled:
                    proc.send_signal(signal.SIGTERM)
                    signalled = True
                elif after is None and len(events) > 5:  # a new connection while draining
                    after = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "sampling" in chunks[-1]
        assert after.status_code == 503 and after.json()["error"]["code"] == "unavailable"
        assert notify.recv(4096).decode().startswith("STOPPING=1")
        assert proc.wait(timeout=60) == 0
    finally:
        notify.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log_text = log_path.read_text()
    assert "Sampling defaults for model" in log_text
    assert "ignores do_sample" in log_text
    assert f"ready: serving 'model' at http://127.0.0.1:{port}" in log_text
    assert "draining" in log_text
    assert '"status": "ok"' in log_text  # the drained request's log line


def test_a_server_process_freezes_its_startup_heap_once_ready():
    """What startup built moves to the permanent generation when the process is ready, so the
    collector stops walking it while requests run; an app served in someone else's process (the
    tests' in-process servers) leaves the heap alone."""
    import gc
    import logging

    from thermostat.api.lifecycle import Lifecycle

    class App(Lifecycle):
        def serving_line(self) -> str:
            return "serving 'test'"

    before = gc.get_freeze_count()
    guest = App(logging.getLogger("test"))
    guest.mark_ready()
    guest.mark_listening("http://127.0.0.1:1")
    assert gc.get_freeze_count() == before
    owner = App(logging.getLogger("test"))
    owner.freeze_heap_when_ready = True
    owner.mark_listening("http://127.0.0.1:1")
    assert gc.get_freeze_count() == before, "not before the app is ready"
    try:
        owner.mark_ready()
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()


def test_the_event_loop_thread_does_not_preempt_the_engine_thread(tmp_path):
    """While an engine serves, the thread of its event loop is SCHED_BATCH (its wake-ups wait for
    a tick or a yield instead of preempting the engine thread before a forward's threads fork:
    thermostat/server/loop_policy.py) and the engine thread keeps SCHED_OTHER; a thread gets its
    policy back from `restore_policy` (AsyncEngine.stop)."""
    from tests.server_utils import running_server
    from thermostat.server.loop_policy import batch_policy, restore_policy

    model = write_model(tmp_path / "model", "llama")
    with running_server(model) as s:
        engine = s.state.engine
        assert engine is not None and engine._thread is not None
        answer = s.client().completions.create(model=s.model, prompt="It was", max_tokens=3)
        assert answer.usage is not None and answer.usage.completion_tokens == 3
        assert os.sched_getscheduler(s.thread.native_id) == os.SCHED_BATCH
        assert os.sched_getscheduler(engine._thread.native_id) == os.SCHED_OTHER

    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    before = batch_policy()
    try:
        assert before == os.SCHED_OTHER and os.sched_getscheduler(0) == os.SCHED_BATCH
        assert batch_policy() is None, "already batch: nothing to restore later"
    finally:
        restore_policy(before)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
