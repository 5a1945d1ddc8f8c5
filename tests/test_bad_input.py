"""Every route against the bad-input battery (tests/bad_inputs.py): never a 5xx, every error in
the OpenAI shape naming the parameter at fault, the server answering a normal request after each
probe, a megabyte prompt refused before it is tokenized, and the process's memory flat over
repeated passes."""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import httpx
import pytest

from tests.bad_inputs import (
    CHAT,
    COMPLETIONS,
    MAX_MODEL_LEN,
    MEGABYTE_TEXT,
    MESSAGES,
    PROBES,
    VALID,
    Probe,
    check_error,
)
from tests.conftest import write_model
from tests.server_utils import RunningServer, running_server

REQUEST_GUARD_S = 120.0  # a hang guard on one request: far above what any probe takes
RSS_SLACK = 0.05  # the second pass may grow RSS by this fraction of the first's
# Every request on a connection of its own (none kept alive: a server that drops one after a
# refusal fails only that request), through one client: building one per request (its TLS
# context) cost ~65 ms, half the battery's time.
CLIENT = httpx.Client(timeout=REQUEST_GUARD_S, limits=httpx.Limits(max_keepalive_connections=0))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_model(tmp_path_factory.mktemp("bad-input"), "llama")
    with CLIENT, running_server(model, max_model_len=MAX_MODEL_LEN, cpu_kernels=False) as s:
        yield s


def send(server: RunningServer, probe: Probe) -> httpx.Response:
    """On a connection of its own (CLIENT)."""
    headers = {"content-type": probe.content_type} if probe.content_type else {}
    return CLIENT.request(
        probe.method, f"{server.url}{probe.path}", content=probe.body(), headers=headers
    )


def check_error_shape(r: httpx.Response, path: str = "") -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}` (Anthropic's shape under
    /v1/messages), served as JSON; returns the error."""
    assert r.headers.get("content-type", "").startswith("application/json"), r.headers
    return check_error(r.json(), path)


def check_serves(server: RunningServer) -> None:
    body = VALID[COMPLETIONS] | {"max_tokens": 1}
    r = CLIENT.post(f"{server.url}{COMPLETIONS}", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


SENT: set[str] = set()  # the probes test_probe sent: a warm-up for the RSS test


@pytest.mark.parametrize("probe", PROBES, ids=[p.id for p in PROBES])
def test_probe(server, probe):
    SENT.add(probe.id)
    r = send(server, probe)
    assert r.status_code < 500, r.text[:300]
    if probe.status:
        assert r.status_code in probe.status, r.text[:300]
    if r.status_code >= 400:
        error = check_error_shape(r, probe.path)
        anthropic = probe.path.startswith(MESSAGES)  # no param or code: the message names it
        if probe.param and anthropic:
            assert any(p in error["message"] for p in probe.param), error
        elif probe.param:
            assert error["param"] in probe.param, error
        if probe.says:
            assert probe.says in error["message"].lower(), error
        if probe.code and not anthropic:
            assert error["code"] == probe.code, error
    check_serves(server)


class TokenizerSpy:
    """Stands in for a fast tokenizer's backend (`tokenizer._tokenizer`), recording the longest
    text it was asked to encode; everything else goes to the real backend."""

    def __init__(self, backend: Any) -> None:
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "longest", 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._backend, name, value)

    def _seen(self, item: Any) -> None:
        texts = [item] if isinstance(item, str) else [t for t in item if isinstance(t, str)]
        object.__setattr__(self, "longest", max([self.longest, *map(len, texts)]))

    def encode(self, sequence: Any, *args: Any, **kwargs: Any) -> Any:
        self._seen(sequence)
        return self._backend.encode(sequence, *args, **kwargs)

    def encode_batch(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        for item in inputs:
            self._seen(item)
        return self._backend.encode_batch(inputs, *args, **kwargs)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (COMPLETIONS, {"prompt": MEGABYTE_TEXT}),
        (COMPLETIONS, {"prompt": MEGABYTE_TEXT, "max_tokens": 1}),
        (CHAT, {"messages": [{"role": "user", "content": MEGABYTE_TEXT}]}),
    ],
    ids=["completions", "completions-max_tokens=1", "chat"],
)
def test_megabyte_prompt_is_refused_before_it_is_tokenized(server, monkeypatch, path, body):
    tokenizer = server.state.prompts.tokenizer
    spy = TokenizerSpy(tokenizer._tokenizer)
    monkeypatch.setattr(tokenizer, "_tokenizer", spy)
    r = CLIENT.post(f"{server.url}{path}", json=body)
    monkeypatch.undo()
    assert r.status_code == 400, r.text[:300]
    error = check_error_shape(r)
    assert error["param"] in ("prompt", "messages") and "context" in error["message"], error
    assert spy.longest < len(MEGABYTE_TEXT) // 10, f"the tokenizer saw {spy.longest} chars"
    check_serves(server)


def rss_bytes() -> int:
    """This process's resident set: the test server runs in it, in a thread."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def run_battery(server: RunningServer, every: int = 1) -> None:
    """Every probe (or every `every`-th) once, each bounded by its request's hang guard; what each
    gets is test_probe's business, not this one's."""
    for probe in PROBES[::every]:
        with contextlib.suppress(httpx.TransportError):
            send(server, probe)
    check_serves(server)


def test_rss_stays_flat_over_the_battery(server):
    """A first pass warms caches and the allocator (test_probe's, when it ran on this server);
    the next must not grow RSS more."""
    if len(SENT) < len(PROBES):
        run_battery(server)
    gc.collect()
    baseline = rss_bytes()
    run_battery(server, every=4)  # 226 refusals and answers: a leak per request shows
    gc.collect()
    after = rss_bytes()
    mib = 2**20
    assert after <= baseline * (1 + RSS_SLACK), (
        f"RSS grew from {baseline / mib:.0f} MiB to {after / mib:.0f} MiB over one pass"
    )
