"""`thermostat gateway` against real upstreams on loopback: Thermostat's own server configured to
be greedy by default (the case), llama.cpp's llama-server when THERMOSTAT_LLAMA_SERVER names a
binary, and a small scripted upstream for the failures (down, slow, garbage, endless streams)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from tests.conftest import write_model
from tests.server_utils import running_server
from tests.waiting import HANG_GUARD_S, hang, wait_until
from thermostat.api.lifecycle import DrainingServer
from thermostat.cli import main
from thermostat.gateway import GatewayConfig, create_gateway_app
from thermostat.sampling import LAYERED_FIELDS, Policy

REPO = Path(__file__).resolve().parents[1]
# The case: the model file says greedy, and the server follows it for omitted fields.
GREEDY_FILE = {"do_sample": False, "temperature": 0.0, "top_p": 1.0, "eos_token_id": 0}
PROMPT = [{"role": "user", "content": "Tell me about the sea."}]


@contextlib.contextmanager
def running_gateway(upstream: str, **options: Any) -> Iterator[str]:
    """A gateway in front of `upstream` on a free loopback port (or `port=`) until the block
    ends."""
    config = GatewayConfig(upstream=upstream, **({"port": 0} | options))
    server = DrainingServer(create_gateway_app(config), config, log_level="warning")
    thread = threading.Thread(target=server.run, name="test-gateway", daemon=True)
    thread.start()
    try:
        wait_until(
            lambda: (
                bool(server.lifecycle.address and server.lifecycle.status == "ready")
                or not thread.is_alive()
            ),
            "the gateway starting",
        )
        assert thread.is_alive(), "the gateway did not start"
        yield server.lifecycle.address
    finally:
        server.should_exit = True
        thread.join(timeout=HANG_GUARD_S)
        assert not thread.is_alive(), hang("the gateway stopping")


def answers(url: str) -> bool:
    """GET `url` is 200."""
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=2).status_code == 200
    return False


def refuses(url: str) -> bool:
    """Nothing listens at `url`."""
    try:
        httpx.get(url, timeout=2)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        pass
    return False


# ---- a scripted upstream: the request's `model` picks the behaviour ----


class Scripted:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.keys: list[str | None] = []  # the Authorization header of each request
        self.closed = threading.Event()  # an endless stream was closed by its client
        self.gone = threading.Event()  # a request that never answers saw its client leave
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/chat/completions")(self.chat)

    async def models(self) -> dict[str, Any]:
        card = {"id": "scripted", "object": "model", "max_model_len": 4096}
        return {"object": "list", "data": [card]}

    async def chat(self, request: Request) -> Any:
        body = await request.json()
        self.bodies.append(body)
        self.keys.append(request.headers.get("authorization"))
        mode = body.get("model")
        if mode == "slow":
            await asyncio.sleep(30)
        if mode == "hang":
            while not await request.is_disconnected():
                await asyncio.sleep(0.05)
            self.gone.set()
            return JSONResponse({})
        if mode == "garbage":
            return PlainTextResponse("<html>502 from some proxy</html>")
        if mode in ("forever", "loop"):
            return StreamingResponse(self._stream(mode), media_type="text/event-stream")
        if body.get("stream"):
            return StreamingResponse(self._answer(), media_type="text/event-stream")
        message = {"role": "assistant", "content": "a calm and quiet sea"}
        choices = [
            {"index": i, "message": message, "finish_reason": "stop"}
            for i in range(body.get("n") or 1)
        ]
        return JSONResponse(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": "scripted",
                "choices": choices,
                "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12},
            }
        )

    async def _answer(self):
        """The plain answer as a stream: two pieces, then usage."""
        head = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "scripted"}
        for text, finish in (("a calm and ", None), ("quiet sea", "stop")):
            delta = {"role": "assistant", "content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            yield f"data: {json.dumps(head | {'choices': [choice]})}\n\n"
        usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
        yield f"data: {json.dumps(head | {'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    async def _stream(self, mode: str):
        try:
            for i in range(10_000):
                text = "the cat sat on the mat. " if mode == "loop" else f"word{i} "
                chunk = {
                    "id": "x",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": mode,
                    "choices": [{"index": 0, "delta": {"content": text}}],
                }
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(0.02)
        finally:
            self.closed.set()


@contextlib.contextmanager
def scripted_upstream(port: int = 0) -> Iterator[tuple[str, Scripted, uvicorn.Server]]:
    scripted = Scripted()
    server = uvicorn.Server(
        uvicorn.Config(
            scripted.app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=1,
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(
            lambda: bool(server.started and server.servers) or not thread.is_alive(),
            "the scripted upstream starting",
        )
        assert thread.is_alive(), "the scripted upstream did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", scripted, server
    finally:
        server.should_exit = True
        thread.join(timeout=HANG_GUARD_S)


# ---- fixtures ----


@pytest.fixture(scope="module")
def greedy_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("greedy"), "llama", generation_config=GREEDY_FILE)


@pytest.fixture(scope="module")
def upstream(greedy_model):
    with running_server(greedy_model) as server:
        yield server


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="client-key", max_retries=0, timeout=60)


# ---- in front of Thermostat, greedy by default ----


def test_discovers_a_thermostat_upstream_and_reports_its_defaults(upstream):
    with running_gateway(upstream.url, sampling_defaults={"temperature": 0.7}) as url:
        report = httpx.get(f"{url}/v1/sampling/defaults").json()
        models = httpx.get(f"{url}/v1/models").json()
    assert report["upstream"]["kind"] == "thermostat"
    assert report["upstream"]["generation_config_known"]
    assert report["effective"]["temperature"] == 0.7
    assert report["source"]["temperature"] == "operator"
    assert report["source"]["top_p"] == "generation_config"
    assert report["source"]["top_k"] == "builtin"
    assert models["data"][0]["id"] == upstream.model


def test_operator_defaults_win_and_go_upstream_explicitly(upstream):
    defaults = {"temperature": 0.7, "top_p": 0.9}
    with running_gateway(upstream.url, sampling_defaults=defaults) as url:
        out = client(url).chat.completions.create(
            model=upstream.model, messages=PROMPT, max_tokens=8
        )
    sampling = out.model_extra["sampling"]
    assert sampling["effective"]["temperature"] == 0.7
    assert sampling["source"]["temperature"] == "operator"
    assert sampling["source"]["top_p"] == "operator"
    assert sampling["source"]["min_p"] == "builtin"
    # what the upstream got: every layered value explicit, so its own defaults decided nothing
    theirs = sampling["upstream"]
    assert {theirs["source"][name] for name in LAYERED_FIELDS} == {"request"}
    assert theirs["effective"]["temperature"] == 0.7
    assert theirs["effective"]["top_p"] == 0.9
    assert out.choices[0].model_extra["quality"]["degenerate"] in (True, False)
    assert out.model_extra["quality"]["signals"]


def test_min_temperature_raises_an_explicit_zero(upstream):
    with running_gateway(upstream.url, policy=Policy(min_temperature=0.3)) as url:
        out = client(url).completions.create(
            model=upstream.model, prompt="Once upon", max_tokens=6, temperature=0
        )
        metrics = httpx.get(f"{url}/metrics").text
    sampling = out.model_extra["sampling"]
    assert sampling["effective"]["temperature"] == 0.3
    assert sampling["adjusted"] == [
        {"param": "temperature", "requested": 0.0, "applied": 0.3, "policy": "min_temperature"}
    ]
    assert sampling["upstream"]["effective"]["temperature"] == 0.3
    assert 'thermostat_policy_adjustments_total{policy="min_temperature"} 1.0' in metrics
    assert 'thermostat_requests_by_temperature_source_total{source="request"} 1.0' in metrics


def test_greedy_reject_is_a_400_that_never_reaches_the_upstream(upstream):
    with running_gateway(upstream.url, policy=Policy(greedy="reject")) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": PROMPT, "temperature": 0})
        metrics = httpx.get(f"{url}/metrics").text
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "greedy_rejected"
    assert r.json()["error"]["param"] == "temperature"
    assert 'thermostat_policy_adjustments_total{policy="greedy_reject"} 1.0' in metrics


def test_stream_final_chunk_carries_sampling_and_quality(upstream):
    with running_gateway(upstream.url, sampling_defaults={"temperature": 0.8}) as url:
        chunks = list(
            client(url).chat.completions.create(
                model=upstream.model,
                messages=PROMPT,
                max_tokens=12,
                stream=True,
                seed=3,
                stream_options={"include_usage": True},
            )
        )
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    final = finals[0]
    assert final.model_extra["sampling"]["effective"]["temperature"] == 0.8
    assert final.model_extra["sampling"]["effective"]["seed"] == 3
    assert final.model_extra["sampling"]["upstream"]["source"]["temperature"] == "request"
    assert "degenerate" in final.model_extra["quality"]
    assert final.choices[0].model_extra["quality"] == final.model_extra["quality"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    before = [c for c in chunks if c is not final]
    assert all("sampling" not in (c.model_extra or {}) for c in before)


def test_console_shows_the_upstream_and_records_whole_and_streamed_requests(upstream):
    with running_gateway(upstream.url, console_keep_text=True) as url:
        c = client(url)
        whole = c.completions.create(model=upstream.model, prompt="a b", max_tokens=5)
        list(c.chat.completions.create(model=upstream.model, messages=PROMPT, max_tokens=4,
                                       temperature=0.5, stream=True))  # fmt: skip
        state = httpx.get(f"{url}/v1/console/state", headers={"Authorization": "Bearer x"})
        detail = httpx.get(f"{url}/v1/console/requests/1").json()
    body = state.json()
    facts, rows = body["facts"], body["requests"]
    assert facts["server"] == "thermostat gateway" and facts["upstream"] == upstream.url
    assert facts["upstream kind"] == "thermostat" and facts["model"] == upstream.model
    assert body["defaults"]["upstream"]["kind"] == "thermostat"
    assert [r["endpoint"] for r in rows] == ["completions", "chat"]
    assert rows[0]["greedy"] and rows[0]["sampling"]["temperature"]["source"] == "generation_config"
    assert rows[1]["sampling"]["temperature"] == {"value": 0.5, "source": "request"}
    assert rows[0]["completion_tokens"] == whole.usage.completion_tokens
    assert all(r["status"] == "ok" and r["finish_reasons"] == ["length"] for r in rows)
    assert detail["sampling"] == whole.model_extra["sampling"]
    assert detail["text"] == [whole.choices[0].text]
    assert body["series"]["totals"]["requests"] == 2


def test_seeded_samples_report_their_own_seed_as_the_upstream_ran_them(upstream):
    with running_gateway(upstream.url, sampling_defaults={"temperature": 0.8}) as url:
        c = client(url)
        out = c.chat.completions.create(
            model=upstream.model, messages=PROMPT, max_tokens=8, n=3, seed=5
        )
        alone = c.chat.completions.create(
            model=upstream.model, messages=PROMPT, max_tokens=8, seed=6
        )
        chunks = list(
            c.chat.completions.create(
                model=upstream.model, messages=PROMPT, max_tokens=8, n=2, seed=5, stream=True
            )
        )
    assert out.model_extra["sampling"]["effective"]["seed"] == 5
    assert "sampling" not in out.choices[0].model_extra  # choice 0's is the response's
    for j in (1, 2):
        own = out.choices[j].model_extra["sampling"]
        assert own["effective"]["seed"] == 5 + j
        assert own["upstream"]["effective"]["seed"] == 5 + j  # what the upstream itself says
        assert own["effective"]["temperature"] == 0.8
    # sample 1 of seed 5 is the sample of seed 6: true upstream, not only said
    assert out.choices[1].message.content == alone.choices[0].message.content
    finals = {c.choices[0].index: c for c in chunks if c.choices and c.choices[0].finish_reason}
    assert {i: f.model_extra["sampling"]["effective"]["seed"] for i, f in finals.items()} == {
        0: 5,
        1: 6,
    }


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_constraints_passed_through_are_reported(upstream):
    with running_gateway(upstream.url) as url:
        c = client(url)
        fmt = c.chat.completions.create(
            model=upstream.model,
            messages=PROMPT,
            max_tokens=4,
            response_format={"type": "json_object"},
        )
        calls = [
            c.chat.completions.create(
                model=upstream.model,
                messages=PROMPT,
                max_tokens=4,
                tools=[WEATHER],
                tool_choice=choice,
            )
            for choice in ("required", {"type": "function", "function": {"name": "weather"}})
        ]
        free = c.chat.completions.create(
            model=upstream.model, messages=PROMPT, max_tokens=4, tools=[WEATHER]
        )
        bad = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": PROMPT, "tools": [WEATHER], "tool_choice": {
                "type": "function", "function": {"name": "nope"}}},
        )  # fmt: skip
    ours = fmt.model_extra["sampling"]["constraint"]
    assert ours == fmt.model_extra["sampling"]["upstream"]["constraint"]  # serve's own report
    assert ours["kind"] == "json_object" and ours["source"] == "response_format"
    reported = [out.model_extra["sampling"]["constraint"] for out in calls]
    assert [r["kind"] for r in reported] == ["tool_call", "tool_call"]
    assert {r["source"] for r in reported} == {"tool_choice"}
    assert reported[0]["hash"] == reported[1]["hash"]  # one tool: required is that tool
    assert len(reported[0]["hash"]) == 12
    upstream_constraint = calls[0].model_extra["sampling"]["upstream"]["constraint"]
    assert upstream_constraint == reported[0]  # serve's own report: one hash, any format
    assert "constraint" not in free.model_extra["sampling"]  # tool_choice auto: no constraint
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"


def test_verify_passes_through_the_gateway_where_it_fails_direct(upstream, capsys):
    direct = main(
        ["verify", upstream.url, "--endpoint", "completions", "--max-tokens", "12", "--json"]
    )
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert direct == 1 and checks["default-sampling"]["status"] == "fail"
    with running_gateway(upstream.url, sampling_defaults={"temperature": 0.8}) as url:
        code = main(["verify", url, "--endpoint", "completions", "--max-tokens", "12", "--json"])
        checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
        diagnosed = main(["diagnose", "--url", url, "--max-tokens", "8", "--json"])
        out = capsys.readouterr()
        cells = json.loads(out.out)["cells"]
        kept = httpx.get(f"{url}/v1/console/state").json()["diagnose"]  # the console shows it
    assert "on the server's console" in out.err
    assert kept["cells"] == cells and kept["cause"] == json.loads(out.out)["cause"]
    assert diagnosed in (0, 1)
    assert [c["decoding"] for c in cells] == ["greedy", "defaults"]
    assert checks["default-sampling"]["status"] == "pass"
    assert "operator" in checks["default-sampling"]["detail"]
    assert checks["greedy"]["status"] == "pass" and checks["seed"]["status"] == "pass"
    assert checks["defaults"]["status"] == "info"
    # random weights write noise that may or may not look degenerate (as in test_commands)
    assert code == (1 if checks["degeneration"]["status"] == "fail" else 0)


def test_gateway_runs_where_torch_cannot_be_imported(upstream):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "from thermostat.cli import main\n"
        f"sys.exit(main(['gateway', '--upstream', {upstream.url!r}, '--port', '{port}',"
        " '--sampling-defaults', 'temperature=0.9', '--drain-timeout', '5']))\n"
    )
    env = os.environ | {"PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: proc.poll() is not None or answers(f"{url}/health"),
            "the torch-free gateway becoming ready",
        )
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        out = client(url).chat.completions.create(
            model=upstream.model, messages=PROMPT, max_tokens=4
        )
        assert out.model_extra["sampling"]["effective"]["temperature"] == 0.9
        assert out.model_extra["sampling"]["source"]["temperature"] == "operator"
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    log = proc.stderr.read() if proc.stderr else ""
    assert code == 0, log
    assert "Sampling defaults for" in log and "kind thermostat" in log


# ---- the upstream failing, and unknown defaults (the scripted upstream) ----


def test_unknown_defaults_are_left_to_the_upstream_and_said_so(caplog):
    caplog.set_level(logging.INFO, logger="thermostat.gateway")
    with scripted_upstream() as (up, scripted, _), running_gateway(up) as url:
        report = httpx.get(f"{url}/v1/sampling/defaults").json()
        out = client(url).chat.completions.create(model="plain", messages=PROMPT)
    assert report["upstream"]["kind"] == "openai"
    assert report["source"]["temperature"] == "upstream"
    assert report["effective"]["temperature"] is None
    assert any("does not know" in w for w in report["warnings"])
    assert out.model_extra["sampling"]["source"]["temperature"] == "upstream"
    sent = scripted.bodies[-1]
    assert "temperature" not in sent and "top_k" not in sent and "max_tokens" not in sent
    # an omitted max_tokens is the upstream's (up to its context), never serve's builtin 256
    assert out.model_extra["sampling"]["source"]["max_tokens"] == "upstream"
    assert out.model_extra["sampling"]["effective"]["max_tokens"] is None
    assert report["upstream"]["context_len"] == 4096
    assert "context length 4096" in caplog.text
    assert "max_tokens" in caplog.text and "the upstream's limit" in caplog.text


def test_a_sent_max_tokens_goes_upstream_an_omitted_one_does_not(tmp_path):
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"temperature": 0.6}))
    with (
        scripted_upstream() as (up, scripted, _),
        running_gateway(up, generation_config=gen) as url,
    ):
        omitted = client(url).chat.completions.create(model="plain", messages=PROMPT)
        sent = client(url).chat.completions.create(model="plain", messages=PROMPT, max_tokens=9)
        report = httpx.get(f"{url}/v1/sampling/defaults").json()
    assert "max_tokens" not in scripted.bodies[0] and scripted.bodies[0]["temperature"] == 0.6
    assert scripted.bodies[1]["max_tokens"] == 9
    assert omitted.model_extra["sampling"]["source"]["max_tokens"] == "upstream"
    assert sent.model_extra["sampling"]["effective"]["max_tokens"] == 9
    assert sent.model_extra["sampling"]["source"]["max_tokens"] == "request"
    assert not any("does not know" in w for w in report["warnings"])


def test_an_operator_max_tokens_is_sent_for_requests_that_omit_it(tmp_path):
    with (
        scripted_upstream() as (up, scripted, _),
        running_gateway(up, sampling_defaults={"max_tokens": 700}) as url,
    ):
        omitted = client(url).chat.completions.create(model="plain", messages=PROMPT)
        sent = client(url).chat.completions.create(model="plain", messages=PROMPT, max_tokens=9)
        report = httpx.get(f"{url}/v1/sampling/defaults").json()
    assert scripted.bodies[0]["max_tokens"] == 700 and scripted.bodies[1]["max_tokens"] == 9
    assert omitted.model_extra["sampling"]["effective"]["max_tokens"] == 700
    assert omitted.model_extra["sampling"]["source"]["max_tokens"] == "operator"
    assert sent.model_extra["sampling"]["source"]["max_tokens"] == "request"
    assert report["effective"]["max_tokens"] == 700 and report["source"]["max_tokens"] == "operator"


def test_a_later_seeded_sample_is_unknown_where_the_upstream_does_not_say():
    with scripted_upstream() as (up, scripted, _), running_gateway(up) as url:
        out = client(url).chat.completions.create(model="plain", messages=PROMPT, n=2, seed=9)
    assert scripted.bodies[0]["seed"] == 9 and scripted.bodies[0]["n"] == 2
    assert out.model_extra["sampling"]["effective"]["seed"] == 9
    own = out.choices[1].model_extra["sampling"]
    assert own["effective"]["seed"] is None and own["source"]["seed"] == "upstream"


def test_openai_kind_refuses_or_reports_what_it_cannot_take(tmp_path):
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"temperature": 0.6, "top_k": 20}))
    with (
        scripted_upstream() as (up, scripted, _),
        running_gateway(up, generation_config=gen) as url,
    ):
        out = client(url).chat.completions.create(model="plain", messages=PROMPT)
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": PROMPT, "top_k": 5})
    sampling = out.model_extra["sampling"]
    assert sampling["source"]["temperature"] == "generation_config"
    assert sampling["source"]["min_p"] == "builtin"
    assert sampling["adjusted"] == [
        {"param": "top_k", "requested": 20, "applied": -1, "policy": "upstream_unsupported"}
    ]
    sent = scripted.bodies[0]
    assert sent["temperature"] == 0.6 and sent["top_p"] == 1.0 and "top_k" not in sent
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"


def test_upstream_down_is_a_502():
    with scripted_upstream() as (up, _, server), running_gateway(up) as url:
        server.should_exit = True
        wait_until(lambda: refuses(up), "the upstream going down")
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": PROMPT})
        s = httpx.post(f"{url}/v1/chat/completions", json={"messages": PROMPT, "stream": True})
        metrics = httpx.get(f"{url}/metrics").text
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
    assert s.status_code == 502
    assert 'thermostat_gateway_upstream_errors_total{kind="upstream_unreachable"} 2.0' in metrics


def test_upstream_slow_is_a_504_within_the_bound():
    """The upstream answers "slow" after 30 s; the client waits 20 s at most, so any answer it
    gets is the gateway's own, sent when its 1 s bound passed."""
    with scripted_upstream() as (up, _, _), running_gateway(up, upstream_timeout_s=1.0) as url:
        r = httpx.post(
            f"{url}/v1/chat/completions", json={"model": "slow", "messages": PROMPT}, timeout=20
        )
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"


def test_upstream_garbage_is_a_502():
    with scripted_upstream() as (up, _, _), running_gateway(up) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "garbage", "messages": PROMPT})
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_bad_response"
    assert r.json()["error"]["type"] == "server_error"


def test_client_disconnect_closes_the_upstream_stream():
    with scripted_upstream() as (up, scripted, _), running_gateway(up) as url:
        body = {"model": "forever", "messages": PROMPT, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data:")
        assert scripted.closed.wait(HANG_GUARD_S), hang("the upstream stream closing")


@pytest.mark.parametrize("stop_on_loop", [False, True])
def test_client_disconnect_aborts_a_whole_request_upstream(stop_on_loop):
    with (
        scripted_upstream() as (up, scripted, _),
        running_gateway(up, stop_on_loop=stop_on_loop) as url,
    ):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{url}/v1/chat/completions",
                json={"model": "hang", "messages": PROMPT},
                timeout=httpx.Timeout(10, read=1),
            )
        assert scripted.gone.wait(HANG_GUARD_S), hang("the upstream request seeing its client go")
        wait_until(
            lambda: "thermostat_requests_running 0.0" in httpx.get(f"{url}/metrics").text,
            "the request leaving flight",
            poll_s=0.1,
        )


def test_stop_on_loop_ends_the_stream_and_closes_the_upstream():
    with scripted_upstream() as (up, scripted, _):
        with running_gateway(up, stop_on_loop=True) as url:
            chunks = list(
                client(url).chat.completions.create(model="loop", messages=PROMPT, stream=True)
            )
        assert scripted.closed.wait(HANG_GUARD_S), hang("the upstream stream closing")
    final = chunks[-1]
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].model_extra["stop_reason"] == "loop"
    assert final.model_extra["quality"]["degenerate"]
    assert len(chunks) < 100


def test_stop_on_loop_cuts_a_whole_response_where_a_stream_is_cut():
    with scripted_upstream() as (up, scripted, _), running_gateway(up, stop_on_loop=True) as url:
        chunks = list(
            client(url).chat.completions.create(model="loop", messages=PROMPT, stream=True)
        )
        assert scripted.closed.wait(HANG_GUARD_S), hang("the upstream stream closing")
        scripted.closed.clear()
        whole = client(url).chat.completions.create(model="loop", messages=PROMPT)
        assert scripted.closed.wait(HANG_GUARD_S), hang("the upstream stream closing")
        plain = client(url).chat.completions.create(model="plain", messages=PROMPT)
    assert scripted.bodies[1]["stream"] is True  # asked as a stream, answered whole
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    choice = whole.choices[0]
    assert choice.message.content == streamed and streamed.count("the cat sat") > 2
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == "loop"
    assert whole.object == "chat.completion"
    assert whole.model_extra["quality"]["degenerate"]
    assert choice.model_extra["quality"] == whole.model_extra["quality"]
    assert whole.model_extra["sampling"]["source"]["temperature"] == "upstream"
    # an answer with no loop comes whole, as the upstream wrote it, usage included
    assert plain.choices[0].message.content == "a calm and quiet sea"
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == 5
    assert not plain.model_extra["quality"]["degenerate"]


def test_generation_tokens_are_counted_from_usage_asked_for_or_not():
    with scripted_upstream() as (up, scripted, _), running_gateway(up) as url:
        c = client(url)
        c.chat.completions.create(model="plain", messages=PROMPT)
        quiet = list(c.chat.completions.create(model="plain", messages=PROMPT, stream=True))
        told = list(
            c.chat.completions.create(
                model="plain",
                messages=PROMPT,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        metrics = httpx.get(f"{url}/metrics").text
    assert "thermostat_generation_tokens_total 15.0" in metrics
    assert scripted.bodies[1]["stream_options"] == {"include_usage": True}
    assert all(chunk.usage is None and chunk.choices for chunk in quiet)
    assert told[-1].usage is not None and told[-1].usage.completion_tokens == 5


def test_health_follows_the_upstream_down_and_back():
    def health(url: str, want: int) -> dict[str, Any]:
        wait_until(
            lambda: httpx.get(f"{url}/health").status_code == want, f"/health {want}", poll_s=0.2
        )
        return httpx.get(f"{url}/health").json()

    with scripted_upstream() as (up, _, server), running_gateway(up) as url:
        assert health(url, 200) == {"status": "ready"}
        server.should_exit = True
        assert health(url, 503) == {"status": "upstream_down"}
        with scripted_upstream(port=int(up.rsplit(":", 1)[1])):
            assert health(url, 200) == {"status": "ready"}


def test_the_client_key_is_not_forwarded_the_upstream_key_is():
    keys = {"api_key": "gw-key", "upstream_api_key": "up-key"}
    with scripted_upstream() as (up, scripted, _), running_gateway(up, **keys) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": PROMPT})
        ok = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": PROMPT},
            headers={"Authorization": "Bearer gw-key"},
        )
    assert r.status_code == 401 and ok.status_code == 200
    assert scripted.keys == ["Bearer up-key"]


# ---- in front of llama.cpp's llama-server ----

LLAMA_SERVER = os.environ.get("THERMOSTAT_LLAMA_SERVER")
GGUF = Path(os.environ.get("THERMOSTAT_LLAMA_GGUF", "/tmp/peers/gguf/tiny-f16.gguf"))


LLAMA_OPT_IN = "set THERMOSTAT_LLAMA_SERVER to a llama-server binary (and THERMOSTAT_LLAMA_GGUF)"


@contextlib.contextmanager
def running_llama_server(*flags: str) -> Iterator[str]:
    """llama-server on GGUF (a free loopback port, 1 thread, a 1,024-token context) until the
    block ends; its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(LLAMA_SERVER), "-m", str(GGUF), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-t", "1", "-c", "1024", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    up = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: proc.poll() is not None or answers(f"{up}/health"), "llama-server loading"
        )
        assert proc.poll() is None, "llama-server exited"
        yield up
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.skipif(not LLAMA_SERVER or not GGUF.is_file(), reason=LLAMA_OPT_IN)
def test_in_front_of_llama_server():
    with (
        running_llama_server() as up,
        running_gateway(up, sampling_defaults={"temperature": 0.0}) as url,
    ):
        report = httpx.get(f"{url}/v1/sampling/defaults").json()
        outs = [
            client(url).completions.create(model="m", prompt="Once upon a time", max_tokens=16)
            for _ in range(2)
        ]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "stop_token_ids": [1]})
    assert report["upstream"]["kind"] == "llamacpp"
    assert report["upstream"]["context_len"] == 1024  # /props n_ctx (-c 1024)
    # llama-server's own defaults (temperature 0.8, top_k 40, min_p 0.05) are known, sourced
    assert report["source"]["top_k"] == "upstream" and report["effective"]["top_k"] == 40
    assert report["source"]["temperature"] == "operator"
    # greedy by the operator's word, though llama-server's own default samples at 0.8
    assert outs[0].choices[0].text == outs[1].choices[0].text
    assert outs[0].model_extra["sampling"]["effective"]["min_p"] == 0.05
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
