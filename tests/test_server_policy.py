"""Operator settings on a live server: --sampling-defaults (values, `recommended`),
--min-temperature, --greedy reject, --max-queue, --api-key."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.conftest import write_model
from tests.server_utils import running_server
from tests.waiting import HANG_GUARD_S, hang
from thermostat.sampling import Policy
from thermostat.sampling.spec import parse_sampling_spec

MESSAGES = [{"role": "user", "content": "hello"}]
GENERIC = {"temperature": 1.0, "top_p": 1.0, "eos_token_id": 0}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    gen = {"temperature": 0.6, "top_p": 0.95, "eos_token_id": 0}
    return write_model(tmp_path_factory.mktemp("llama"), "llama", generation_config=gen)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("qwen3"), "qwen3", generation_config=GENERIC)


def ask(server, **fields):
    return server.client().chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=2, **fields
    )


def test_operator_defaults_beat_the_model_file(llama_dir):
    spec = parse_sampling_spec("temperature=0.2")
    with running_server(llama_dir, sampling_defaults=spec) as s:
        r = ask(s)
        assert r.sampling["effective"]["temperature"] == 0.2
        assert r.sampling["source"]["temperature"] == "operator"
        assert r.sampling["source"]["top_p"] == "generation_config"  # not overridden
        d = httpx.get(f"{s.url}/v1/sampling/defaults").json()
        assert d["source"]["temperature"] == "operator" and d["operator"] == {"temperature": 0.2}
        assert ask(s, temperature=0.9).sampling["source"]["temperature"] == "request"


def test_an_omitted_max_tokens_runs_to_the_end_unless_the_operator_caps_it(llama_dir):
    messages = [{"role": "user", "content": "Tell me a long story."}]
    body = dict(messages=messages, temperature=0.0, extra_body={"ignore_eos": True})
    with running_server(llama_dir, max_model_len=400) as s:
        r = s.client().chat.completions.create(model=s.model, **body)
        prompt = r.usage.prompt_tokens
        assert r.usage.completion_tokens == 400 - prompt > 256  # no builtin 256 cut
        assert r.choices[0].finish_reason == "length"
        assert r.sampling["effective"]["max_tokens"] == 400 - prompt
        assert r.sampling["source"]["max_tokens"] == "context_length"
        d = httpx.get(f"{s.url}/v1/sampling/defaults").json()
        assert d["effective"]["max_tokens"] is None
        assert d["source"]["max_tokens"] == "context_length"
    spec = parse_sampling_spec("max_tokens=20")
    with running_server(llama_dir, max_model_len=400, sampling_defaults=spec) as s:
        r = s.client().chat.completions.create(model=s.model, **body)
        assert r.usage.completion_tokens == 20 == r.sampling["effective"]["max_tokens"]
        assert r.sampling["source"]["max_tokens"] == "operator"
        chunks = list(s.client().chat.completions.create(model=s.model, stream=True, **body))
        assert chunks[-1].sampling["source"]["max_tokens"] == "operator"
        d = httpx.get(f"{s.url}/v1/sampling/defaults").json()
        assert d["effective"]["max_tokens"] == 20 and d["operator"] == {"max_tokens": 20}


def test_recommended_applies_the_family_table(qwen3_dir):
    with running_server(qwen3_dir, sampling_defaults="recommended") as s:
        r = ask(s)
        eff, src = r.sampling["effective"], r.sampling["source"]
        assert (eff["temperature"], eff["top_p"], eff["top_k"]) == (0.6, 0.95, 20)
        assert src["temperature"] == src["top_p"] == src["top_k"] == "recommended"
        d = httpx.get(f"{s.url}/v1/sampling/defaults").json()
        assert d["recommended"]["family"] == "qwen3" and d["recommended"]["applied"] is True
        assert not any("generic" in w for w in d["warnings"])


def test_generic_model_file_is_warned_about(qwen3_dir):
    with running_server(qwen3_dir) as s:
        d = httpx.get(f"{s.url}/v1/sampling/defaults").json()
        assert d["source"]["temperature"] == "generation_config"
        assert d["effective"]["temperature"] == 1.0
        assert d["recommended"]["applied"] is False
        [warning] = [w for w in d["warnings"] if "generic" in w]
        assert "qwen3" in warning and "--sampling-defaults recommended" in warning


def test_min_temperature_raises_an_explicit_zero(llama_dir):
    with running_server(llama_dir, policy=Policy(min_temperature=0.3)) as s:
        r = ask(s, temperature=0)
        assert r.sampling["effective"]["temperature"] == 0.3
        assert r.sampling["adjusted"] == [
            {"param": "temperature", "requested": 0.0, "applied": 0.3, "policy": "min_temperature"}
        ]
        metrics = httpx.get(f"{s.url}/metrics").text
        assert 'thermostat_policy_adjustments_total{policy="min_temperature"} 1.0' in metrics
        assert ask(s, temperature=0.5).sampling["adjusted"] == []


def test_greedy_reject_answers_400(llama_dir):
    with running_server(llama_dir, policy=Policy(greedy="reject")) as s:
        with pytest.raises(openai.BadRequestError) as info:
            ask(s, temperature=0)
        error = info.value.body
        assert error["param"] == "temperature" and "greedy" in error["message"]
        explain = httpx.post(f"{s.url}/v1/sampling/explain", json={"temperature": 0})
        assert explain.status_code == 400 and "greedy" in explain.json()["error"]["message"]
        assert ask(s).sampling["source"]["temperature"] == "generation_config"  # omitted: fine
        metrics = httpx.get(f"{s.url}/metrics").text
        assert 'thermostat_policy_adjustments_total{policy="greedy_reject"} 1.0' in metrics
        refused, served = httpx.get(f"{s.url}/v1/console/state").json()["requests"]
        assert refused["status"] == "refused" and refused["policies"] == ["greedy_reject"]
        assert "greedy" in refused["error"] and served["status"] == "ok"


def test_max_queue_503_with_retry_after(llama_dir, monkeypatch):
    with running_server(llama_dir, max_queue=1) as s:
        gate = threading.Event()  # holds the engine's next step: the first request stays waiting
        real_step = s.engine.step

        def held_step(**kwargs):
            assert gate.wait(HANG_GUARD_S), hang("the test opening the gate")
            return real_step(**kwargs)

        monkeypatch.setattr(s.engine, "step", held_step)
        first = {"model": s.model, "prompt": "It was", "max_tokens": 4, "stream": True}
        with (
            httpx.Client(base_url=s.url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=first) as held,
        ):
            assert held.status_code == 200  # queued: its add was applied, stats published
            try:
                r = httpx.post(
                    f"{s.url}/v1/completions",
                    json={"prompt": "x", "max_tokens": 1},
                    timeout=HANG_GUARD_S,
                )
                assert r.status_code == 503
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
            finally:
                gate.set()
            assert '"finish_reason":"length"' in held.read().decode()
        ok = httpx.post(
            f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=HANG_GUARD_S
        )
        assert ok.status_code == 200


def test_api_key(llama_dir):
    with running_server(llama_dir, api_key="s3cret") as s:
        body = {"prompt": "x", "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(f"{s.url}/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for path in ("/v1/models", "/v1/sampling/defaults"):
            assert httpx.get(f"{s.url}{path}").status_code == 401
        assert httpx.post(f"{s.url}/tokenize", json={"prompt": "x"}).status_code == 401
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert httpx.get(f"{s.url}/metrics").status_code == 200
        ok = s.client(api_key="s3cret").completions.create(model=s.model, prompt="x", max_tokens=1)
        assert ok.choices[0].finish_reason in ("length", "stop")
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
