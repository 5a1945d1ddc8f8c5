"""Bad input gets a 4xx in the OpenAI error shape naming the parameter: never a 500, never a
silent clamp. An engine crash fails the requests in flight and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import write_model
from tests.server_utils import running_server

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(write_model(tmp_path_factory.mktemp("errors"), "llama")) as s:
        yield s


def chat(**fields):
    return ("/v1/chat/completions", {"messages": MESSAGES} | fields)


def completion(**fields):
    return ("/v1/completions", {"prompt": "It was the"} | fields)


BAD = [
    # (request, status, param)
    (chat(temperature=-0.1), 400, "temperature"),
    (chat(temperature=2.5), 400, "temperature"),
    (chat(temperature="hot"), 400, "temperature"),
    (chat(temperature="0.5"), 400, "temperature"),
    (chat(top_p=0), 400, "top_p"),
    (chat(top_p=1.5), 400, "top_p"),
    (chat(top_k=0), 400, "top_k"),
    (chat(top_k=-2), 400, "top_k"),
    (chat(min_p=1.5), 400, "min_p"),
    (chat(repetition_penalty=0), 400, "repetition_penalty"),
    (chat(frequency_penalty=3), 400, "frequency_penalty"),
    (chat(n=0), 400, "n"),
    (chat(n=True), 400, "n"),
    (chat(max_tokens=-1), 400, "max_tokens"),
    (chat(max_tokens=1.5), 400, "max_tokens"),
    (chat(max_completion_tokens=-5), 400, "max_tokens"),
    (chat(max_tokens=600), 400, "max_tokens"),  # prompt + 600 > context length 512
    (completion(max_tokens=510), 400, "max_tokens"),
    (chat(min_tokens=5, max_tokens=2), 400, "min_tokens"),
    (chat(model="no-such-model"), 404, "model"),
    (chat(messages=[]), 400, "messages"),
    (("/v1/chat/completions", {"model": "x"}), 400, "messages"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "messages"),
    (completion(prompt=""), 400, "prompt"),
    (completion(prompt=[]), 400, "prompt"),
    (completion(prompt=[[]]), 400, "prompt"),
    (completion(prompt=[1, 99999]), 400, "prompt"),
    (chat(stop=""), 400, "stop"),
    (chat(stop=[1]), 400, "stop"),
    (chat(stop_token_ids=[99999]), 400, "stop_token_ids"),
    (chat(top_logprobs=2), 400, "top_logprobs"),
    (chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (completion(logprobs=-1), 400, "logprobs"),
    (chat(seed=1.5), 400, "seed"),
    (chat(seed=2**64), 400, "seed"),
    (chat(top_k=2**70), 400, "top_k"),
    (chat(n=1000), 400, "n"),
    (chat(ignore_eos="yes"), 400, "ignore_eos"),
    (chat(stream=True, temperature=5), 400, "temperature"),  # refused before any SSE byte
    (completion(stream=True, prompt=""), 400, "prompt"),
]


@pytest.mark.parametrize(("request_", "status", "param"), BAD, ids=[str(b[0][1]) for b in BAD])
def test_bad_input_is_a_4xx_naming_the_param(server, request_, status, param):
    path, body = request_
    r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"] and "code" in error


def test_malformed_json_and_non_object_bodies(server):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/sampling/explain"):
        r = httpx.post(
            f"{server.url}{path}",
            content=b'{"messages": [',
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server.url}/v1/completions", json=[1, 2])
    assert r.status_code == 400


def test_unknown_route_is_openai_shaped(server):
    r = httpx.get(f"{server.url}/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_openai_client_sees_bad_request(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, messages=MESSAGES, temperature=3)
    assert info.value.body["param"] == "temperature"


def test_engine_crash_fails_in_flight_then_serves(server, monkeypatch):
    engine = server.engine
    real_step = engine.step
    calls = {"n": 0}

    def failing_step(**kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real_step(**kwargs)

    monkeypatch.setattr(engine, "step", failing_step)
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "It was the", "max_tokens": 4},
        timeout=30,
    )
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert "simulated kernel failure" in r.json()["error"]["message"]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    ok = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "It was the", "max_tokens": 4, "ignore_eos": True},
        timeout=30,
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_a_bug_that_raises_valueerror_is_a_500_with_an_error_id_never_a_400(
    server, monkeypatch, caplog
):
    """A ValueError out of the engine is ours, not the client's: 500, an error id that the log
    line carries with the traceback, counted in /metrics; the engine keeps nothing queued."""
    engine = server.engine

    def buggy_add_group(*args, **kwargs):
        raise ValueError("an engine bug")

    monkeypatch.setattr(engine, "add_group", buggy_add_group)
    before = httpx.get(f"{server.url}/metrics", timeout=10).text
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "It was the"}, timeout=30)
    monkeypatch.undo()
    error = r.json()["error"]
    assert r.status_code == 500 and error["code"] == "internal_error"
    error_id = error["message"].split("error id ")[1].split(";")[0]
    assert "an engine bug" not in error["message"]  # details stay in the log
    logged = [rec for rec in caplog.records if error_id in rec.getMessage()]
    assert logged and logged[0].exc_info is not None
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    line = 'thermostat_server_errors_total{code="internal_error"}'
    count = {
        t: float(m.split(line)[1].split()[0]) if line in m else 0.0
        for t, m in (("before", before), ("after", metrics))
    }
    assert count["after"] == count["before"] + 1
    assert not engine.has_unfinished()
