"""The case's topology on loopback: `thermostat serve` as prefill and as decode (subprocesses),
SGLang's router `smg` in front (`pip install smg==1.13.0`, in the test extra), the official
`openai` client. Through the router the answers equal a single server's; a decode restarted with
other sampling defaults is refused with the fields named; a decode or prefill killed with
SIGKILL ends its requests with a clean error, and the restarted worker is taken back."""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.conftest import write_model
from tests.server_utils import running_server
from tests.waiting import HANG_GUARD_S, hang
from thermostat.disagg.router import RouterConfig, find_smg, smg_command

REPO = Path(__file__).resolve().parent.parent
SMG = find_smg()
pytestmark = pytest.mark.skipif(SMG is None, reason="smg is not installed (pip install smg)")
GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
PD_WAIT_S = "60"  # each half's wait for the other: a hang guard, nothing here waits it out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, proc: subprocess.Popen, log: Path, *others: Path) -> None:
    """Until `url` answers 200; on a hang, the failure shows the last answer and the logs."""
    deadline, last = time.monotonic() + HANG_GUARD_S, "no answer"
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url} exited:\n{log.read_text()[-3000:]}"
        with contextlib.suppress(httpx.TransportError):
            answer = httpx.get(url, timeout=2)
            if answer.status_code == 200:
                return
            last = f"{answer.status_code} {answer.text[:500]}"
        time.sleep(0.2)
    tails = "".join(f"\n--- {p.name}:\n{p.read_text()[-1500:]}" for p in (log, *others))
    raise AssertionError(f"{hang(url + ' ready')} (last: {last}){tails}")


@dataclass
class Worker:
    argv: list[str]
    port: int
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *extra: str) -> Worker:
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                [*self.argv, *extra], cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            )
        wait_for(f"{self.url}/health", self.proc, self.log)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)

    def kv_usage(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return float(re.search(r"^thermostat_kv_cache_usage_ratio (\S+)$", text, re.M)[1])


@dataclass
class Topology:
    prefill: Worker
    decode: Worker
    router_url: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.router_url}/v1", api_key="x", max_retries=0, timeout=60
        )


def serve_argv(model: Path, port: int, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "thermostat.cli", "serve", "--model", str(model),
        "--port", str(port), "--kv-cache-memory-gb", "0.004", "--served-model-name", "m", *flags,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("pd-smg"), "llama", dtype=torch.bfloat16)


@contextlib.contextmanager
def pd_topology(model_dir: Path, logs: Path, *flags: str) -> Iterator[Topology]:
    """Prefill, decode (both with `flags`) and smg on free loopback ports, until the block ends."""
    boot, pp, dp, rp = free_port(), free_port(), free_port(), free_port()
    prefill = Worker(
        serve_argv(model_dir, pp, "--disaggregation-mode", "prefill",
                   "--disaggregation-bootstrap-port", str(boot),
                   "--disaggregation-timeout", PD_WAIT_S, *flags),
        pp, logs / "prefill.log",
    )  # fmt: skip
    decode = Worker(
        serve_argv(model_dir, dp, "--disaggregation-mode", "decode",
                   "--disaggregation-timeout", PD_WAIT_S, *flags),
        dp, logs / "decode.log",
    )  # fmt: skip
    config = RouterConfig(
        port=rp,
        prometheus_port=free_port(),
        prefill_url=prefill.url,
        bootstrap_port=boot,
        decode_url=decode.url,
        log_level="warn",
    )
    router_log = logs / "router.log"
    workers: list[Worker] = []
    router = None
    try:
        workers = [prefill.start(), decode.start()]
        with router_log.open("w") as log:
            router = subprocess.Popen(
                smg_command(config, SMG or "smg"), stdout=log, stderr=subprocess.STDOUT
            )
        wait_for(f"http://127.0.0.1:{rp}/readiness", router, router_log, prefill.log, decode.log)
        yield Topology(prefill, decode, f"http://127.0.0.1:{rp}")
    finally:
        for proc in [router, *(w.proc for w in workers)]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


@pytest.fixture(scope="module")
def topology(model_dir, tmp_path_factory) -> Iterator[Topology]:
    with pd_topology(model_dir, tmp_path_factory.mktemp("logs")) as t:
        yield t


@pytest.fixture(scope="module")
def single(model_dir):
    with running_server(model_dir, served_model_name="m") as s:
        yield s.client()


def completion_texts(client: openai.OpenAI, **kwargs) -> list[str]:
    out = client.completions.create(model="m", **kwargs)
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def test_through_the_router_equals_a_single_server(topology, single):
    client = topology.client()
    for prompt in ["The quick brown fox", ["one prompt", "and another"]]:
        assert completion_texts(client, prompt=prompt, **GREEDY) == completion_texts(
            single, prompt=prompt, **GREEDY
        )
    seeded = {"prompt": "Once", "temperature": 0.5, "seed": 11, "n": 3, "max_tokens": 10}
    assert completion_texts(client, **seeded) == completion_texts(single, **seeded)
    messages = [{"role": "user", "content": "Say something"}]
    stream = client.chat.completions.create(model="m", messages=messages, stream=True, **GREEDY)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    whole = single.chat.completions.create(model="m", messages=messages, **GREEDY)
    assert streamed == whole.choices[0].message.content
    routed = client.completions.create(model="m", prompt="x", **GREEDY).model_extra["sampling"]
    assert routed["disaggregation"]["agreed"] == ["model", "kv_cache", "prompt", "sampling"]


def test_fp8_kv_through_the_router_equals_an_fp8_single_server(model_dir, tmp_path):
    fp8 = ("--kv-cache-dtype", "fp8_e4m3")
    with (
        pd_topology(model_dir, tmp_path, *fp8) as pd,
        running_server(model_dir, served_model_name="m", kv_cache_dtype="fp8_e4m3") as one,
    ):
        for prompt in ["The quick brown fox", "Another prompt entirely"]:
            assert completion_texts(pd.client(), prompt=prompt, **GREEDY) == completion_texts(
                one.client(), prompt=prompt, **GREEDY
            )


def test_concurrent_clients(topology, single):
    prompts = [f"Prompt number {i}" for i in range(6)]
    results: dict[int, list[str]] = {}

    def one(i: int) -> None:
        results[i] = completion_texts(topology.client(), prompt=prompts[i], **GREEDY)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results[i] for i in range(len(prompts))] == [
        completion_texts(single, prompt=p, **GREEDY) for p in prompts
    ]
    assert topology.prefill.kv_usage() == 0.0 and topology.decode.kv_usage() == 0.0


def stream_until_broken(client: openai.OpenAI, kill, timeout_s: float = 30) -> tuple[float, str]:
    """Stream a long completion, call `kill()` after a few chunks; (seconds from the kill to
    the end of the stream, how it ended)."""
    killed_at = None
    ended = "done"
    try:
        stream = client.completions.create(
            model="m", prompt="Long", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        )
        for i, _ in enumerate(stream):
            if i == 3:
                kill()
                killed_at = time.monotonic()
            if killed_at and time.monotonic() - killed_at > timeout_s:
                ended = "hung"
                break
    except (openai.APIError, httpx.HTTPError) as exc:
        ended = f"error: {type(exc).__name__}"
    assert killed_at is not None
    return time.monotonic() - killed_at, ended


def wait_routed(client: openai.OpenAI):
    """Send until the router answers with something other than 'no worker'; the last answer."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        try:
            return completion_texts(client, prompt="back?", **GREEDY)
        except openai.APIStatusError as exc:
            if exc.status_code != 503 or time.monotonic() > deadline:
                raise
        except openai.APIConnectionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def test_killed_decode_then_restarted_with_other_defaults_then_recovered(topology, single):
    client = topology.client()
    decode = topology.decode
    seconds, ended = stream_until_broken(client, decode.kill)
    assert ended != "hung" and seconds < 30, f"hang guard: {ended} {seconds:.0f} s after the kill"
    assert topology.prefill.kv_usage() == 0.0

    decode.start("--sampling-defaults", "top_p=0.9")  # one half restarted with new defaults
    with pytest.raises(openai.APIStatusError) as refused:
        wait_routed(client)
    message = str(refused.value)  # smg passes on the decode's 409 message, as a 500
    assert "would serve choice 0 differently" in message
    assert "top_p: prefill 1.0 (builtin), decode 0.9 (operator)" in message

    decode.kill(signal.SIGTERM)
    decode.start()
    assert wait_routed(client) == completion_texts(single, prompt="back?", **GREEDY)
    assert topology.prefill.kv_usage() == 0.0 and decode.kv_usage() == 0.0


def test_killed_prefill_ends_the_decode_wait_cleanly_and_recovers(topology, single):
    client = topology.client()
    prefill = topology.prefill
    prefill.kill()
    start = time.monotonic()
    with pytest.raises((openai.APIStatusError, openai.APIConnectionError)):
        completion_texts(client, prompt="nobody prefills this", **GREEDY)
    assert time.monotonic() - start < 30, "hang guard: the decode waited on a dead prefill"
    assert topology.decode.kv_usage() == 0.0
    prefill.start()
    assert wait_routed(client) == completion_texts(single, prompt="back?", **GREEDY)
    assert prefill.kv_usage() == 0.0 and topology.decode.kv_usage() == 0.0
