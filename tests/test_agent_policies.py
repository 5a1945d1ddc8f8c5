"""The operator's settings hold the same on the three APIs a coding agent may use: chat
completions, Responses and Messages. One table: each setting, one request per API, the same
`sampling`, `quality`, refusal or key check."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.server_utils import running_server
from thermostat.engine.loader import DEMO_MODEL_DIR
from thermostat.sampling import Policy

NEWS = "My lord, I have news from the north."  # greedy decoding loops on the demo model


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict[str, Any]

    @property
    def sampling(self) -> dict[str, Any]:
        return self.body["sampling"]

    @property
    def quality(self) -> dict[str, Any]:
        return self.body["quality"]

    @property
    def error(self) -> str:
        return self.body["error"]["message"]


def send(url: str, api: str, max_tokens: int, headers: dict | None = None, **fields) -> Answer:
    """One user turn of `NEWS` through `api`, with `fields` (sampling) as that API sends them."""
    if api == "chat":
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": NEWS}], "max_tokens": max_tokens}
    elif api == "responses":
        path, body = "/v1/responses", {"input": NEWS, "max_output_tokens": max_tokens}
    else:
        path = "/v1/messages"
        body = {"messages": [{"role": "user", "content": NEWS}], "max_tokens": max_tokens}
    r = httpx.post(url + path, json=body | fields, headers=headers or {}, timeout=60)
    return Answer(r.status_code, r.json())


def completion_tokens(api: str, body: dict[str, Any]) -> int:
    usage = body["usage"]
    return usage["completion_tokens" if api == "chat" else "output_tokens"]


APIS = ["chat", "responses", "messages"]


@pytest.fixture(scope="module")
def servers():
    """One server per setting under test, started once for the module."""
    settings = {
        "min_temperature": dict(policy=Policy(min_temperature=0.3)),
        "greedy_reject": dict(policy=Policy(greedy="reject")),
        "operator": dict(sampling_defaults={"temperature": 0.2, "top_p": 0.8}),
        "stop_on_loop": dict(stop_on_loop=True),
        "api_key": dict(api_key="sesame"),
    }
    with contextlib.ExitStack() as stack:
        yield {
            name: stack.enter_context(running_server(DEMO_MODEL_DIR, **options)).url
            for name, options in settings.items()
        }


@pytest.mark.parametrize("api", APIS)
def test_min_temperature_raises_an_explicit_zero(servers, api):
    a = send(servers["min_temperature"], api, 4, temperature=0)
    assert a.status == 200
    assert a.sampling["effective"]["temperature"] == 0.3
    assert a.sampling["adjusted"] == [
        {"param": "temperature", "requested": 0.0, "applied": 0.3, "policy": "min_temperature"}
    ]


@pytest.mark.parametrize("api", APIS)
def test_greedy_reject_refuses_an_explicit_zero_and_says_why(servers, api):
    a = send(servers["greedy_reject"], api, 4, temperature=0)
    assert a.status == 400
    message = a.body["error"]["message"]
    assert "greedy" in message
    if api == "messages":
        assert a.body["type"] == "error" and a.body["error"]["type"] == "invalid_request_error"
    assert send(servers["greedy_reject"], api, 2).status == 200  # omitted: not greedy


@pytest.mark.parametrize("api", APIS)
def test_operator_defaults_fill_what_the_client_omits(servers, api):
    a = send(servers["operator"], api, 2)
    assert a.sampling["effective"]["temperature"] == 0.2
    assert a.sampling["source"]["temperature"] == "operator"
    assert a.sampling["source"]["top_k"] == "builtin"
    sent = send(servers["operator"], api, 2, temperature=0.9)
    assert sent.sampling["source"]["temperature"] == "request"


@pytest.mark.parametrize("api", APIS)
def test_stop_on_loop_cuts_a_greedy_loop_and_flags_it(servers, api):
    a = send(servers["stop_on_loop"], api, 300, temperature=0)
    assert a.status == 200
    assert a.quality["degenerate"] and "loop" in a.quality["flags"]
    assert completion_tokens(api, a.body) < 300


@pytest.mark.parametrize("api", APIS)
def test_the_api_key_is_required_and_taken_either_way(servers, api):
    url = servers["api_key"]
    refused = send(url, api, 1)
    assert refused.status == 401
    for headers in ({"Authorization": "Bearer sesame"}, {"x-api-key": "sesame"}):
        assert send(url, api, 1, headers=headers).status == 200


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_verify_and_diagnose_probe_through_the_agents_apis(servers, api, capsys):
    from thermostat.cli import main

    url, key = servers["api_key"], ["--api-key", "sesame"]
    code = main(["verify", url, "--endpoint", api, "--max-tokens", "16", "--json", *key])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["default-sampling"]["status"] == "pass"
    assert checks["greedy"]["status"] == "pass" and checks["seed"]["status"] == "pass"
    assert "generation_config" in checks["defaults"]["detail"]
    assert checks["provenance"]["status"] == "pass"
    assert code == (1 if checks["degeneration"]["status"] == "fail" else 0)
    args = ["diagnose", "--url", url, "--endpoint", api, "--max-tokens", "24", "--json", *key]
    assert main(args) in (0, 1)
    assert json.loads(capsys.readouterr().out)
