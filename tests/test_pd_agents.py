"""The coding agents' APIs on a prefill/decode pair: OpenAI's Responses API and Anthropic's
Messages API answer as a single server does (the same text and token counts, greedy and seeded,
whole and streamed), with `sampling` saying the halves agreed.

What SGLang's router (`smg` 1.13.0, as tests/test_pd_smg.py runs it) does with these routes,
measured:

| route                           | smg in PD mode                                               |
|---------------------------------|--------------------------------------------------------------|
| POST /v1/messages               | the body (re-serialized; fields it does not know, such as    |
|                                 | `seed`, kept) to both halves, bootstrap fields added; the    |
|                                 | decode's answer, whole or streamed                           |
| POST /v1/responses              | the same, but the body is read into smg's own type first: a  |
|                                 | field it does not know (`seed`, `ignore_eos`) is its 400     |
|                                 | `unknown_parameter`; it writes `top_k: -1, min_p: 0.0,       |
|                                 | repetition_penalty: 1.0, priority: 0` when they are left     |
|                                 | out, so the decode takes them as the request's values (over  |
|                                 | the servers' own defaults for them)                          |
| POST /v1/messages/count_tokens  | the body as sent, to one worker (the prefill), no bootstrap  |
| POST /v1/responses/input_tokens | smg's own 405 (it has GET, HEAD, DELETE /v1/responses/{id})  |
| GET/DELETE /v1/responses/{id}   | smg's own 404: it stores nothing it routes in PD mode        |

Only the decode stores the Responses it answers (the prefill's answer is its handoff), so a
`previous_response_id` is the prefill's 404, which smg passes on as its 404 `prefill_not_found`.

So the Responses API goes through the router greedy only; a seeded Responses request, and the
input-token count, are sent to the pair directly (tests/test_pd_server.py's way: the same body
to both halves at once, bootstrap fields added).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
import torch

from tests.conftest import write_model
from tests.server_utils import RunningServer, running_server
from tests.test_pd_smg import SMG, Topology, pd_topology
from tests.waiting import HANG_GUARD_S

pytestmark = pytest.mark.skipif(SMG is None, reason="smg is not installed (pip install smg)")

AGREED = ["model", "kv_cache", "prompt", "sampling"]
MESSAGES = [{"role": "user", "content": "Say something"}]
SEEDED = {"temperature": 0.8, "seed": 7}
# smg fills these into a Responses body that leaves them out (see the table above)
SMG_RESPONSES_DEFAULTS = ("top_k", "min_p", "repetition_penalty")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("pd-agents"), "llama", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def pd(model_dir, tmp_path_factory) -> Iterator[Topology]:
    with pd_topology(model_dir, tmp_path_factory.mktemp("logs")) as t:
        yield t


@pytest.fixture(scope="module")
def single(model_dir) -> Iterator[RunningServer]:
    with running_server(model_dir, served_model_name="m") as s:
        yield s


def gpt(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


def claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60)


def effective(sampling: dict[str, Any]) -> dict[str, Any]:
    return sampling["effective"]


def assert_disaggregated(sampling: dict[str, Any]) -> None:
    assert sampling["disaggregation"]["agreed"] == AGREED


def assert_idle(pd: Topology) -> None:
    assert pd.prefill.kv_usage() == 0.0 and pd.decode.kv_usage() == 0.0


# ---- the pair driven directly, as smg drives it ----


def both_halves(
    pd: Topology, path: str, body: dict[str, Any]
) -> tuple[httpx.Response, httpx.Response]:
    """POST `body` to both halves at once with bootstrap fields added; (prefill, decode)."""
    info = httpx.get(f"{pd.prefill.url}/server_info", timeout=10).json()
    full = body | {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": info["disaggregation_bootstrap_port"],
        "bootstrap_room": random.randrange(2**63),
    }

    async def both():
        async with httpx.AsyncClient(timeout=HANG_GUARD_S) as client:
            return await asyncio.gather(
                client.post(f"{pd.prefill.url}{path}", json=full),
                client.post(f"{pd.decode.url}{path}", json=full),
            )

    return asyncio.run(both())


def direct(pd: Topology, path: str, body: dict[str, Any]) -> tuple[httpx.Response, httpx.Response]:
    """`both_halves`, each answering 200."""
    prefill, decode = both_halves(pd, path, body)
    assert prefill.status_code == 200, prefill.text
    assert prefill.json()["object"] == "prefill"
    assert decode.status_code == 200, decode.text
    return prefill, decode


def named_events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """A stream's (event name, data) pairs."""
    assert response.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in response.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            data = json.loads(lines["data"])
            assert data["type"] == lines["event"]
            out.append((lines["event"], data))
    return out


# ---- Responses ----


def responses_answer(response) -> tuple[str, str, int]:
    return response.status, response.output_text, response.usage.output_tokens


def streamed_response(client: openai.OpenAI, **ask):
    """The Response the SDK's stream ends with."""
    with client.responses.stream(**ask) as stream:
        events = list(stream)
    assert events[-1].type in ("response.completed", "response.incomplete"), events[-1].type
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events[-1].response


@pytest.mark.parametrize(
    "ask",
    [
        {"input": "The quick brown fox"},
        {"input": [{"role": "user", "content": "Hi"}], "instructions": "Be brief."},
    ],
    ids=["text", "instructions"],
)
def test_responses_through_the_router_equal_a_single_server(pd, single, ask):
    ask = {"model": "m", "max_output_tokens": 12, "temperature": 0} | ask
    want = gpt(single.url).responses.create(**ask)
    assert want.usage.output_tokens > 0
    routed = gpt(pd.router_url)
    for got in (routed.responses.create(**ask), streamed_response(routed, **ask)):
        assert responses_answer(got) == responses_answer(want)
        assert got.usage.input_tokens == want.usage.input_tokens
        assert effective(got.sampling) == effective(want.sampling)
        assert_disaggregated(got.sampling)
        for name in SMG_RESPONSES_DEFAULTS:  # written by smg, not sent by the client
            assert (got.sampling["source"][name], want.sampling["source"][name]) == (
                "request",
                "builtin",
            )
    assert_idle(pd)


def test_seeded_responses_from_the_pair_equal_a_single_server(pd, single):
    """smg refuses `seed` in a Responses body, so the pair is driven directly."""
    body = {"model": "m", "input": "Once upon", "max_output_tokens": 12} | SEEDED
    assert body["seed"] == 7
    refused = httpx.post(f"{pd.router_url}/v1/responses", json=body, timeout=HANG_GUARD_S)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "seed"  # smg's own answer
    assert refused.json()["error"]["code"] == "unknown_parameter"

    ask = {"model": "m", "input": "Once upon", "max_output_tokens": 12, "temperature": 0.8}
    want = gpt(single.url).responses.create(**ask, extra_body={"seed": 7})
    assert effective(want.sampling)["seed"] == 7
    _, whole = direct(pd, "/v1/responses", body)
    got = whole.json()
    text = "".join(p["text"] for item in got["output"] for p in item["content"])
    assert (got["status"], text, got["usage"]["output_tokens"]) == responses_answer(want)
    assert effective(got["sampling"]) == effective(want.sampling)
    assert_disaggregated(got["sampling"])

    _, stream = direct(pd, "/v1/responses", body | {"stream": True})
    events = named_events(stream)
    deltas = "".join(e["delta"] for kind, e in events if kind == "response.output_text.delta")
    kind, last = events[-1]
    assert kind in ("response.completed", "response.incomplete")
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    final = last["response"]
    assert (final["status"], deltas, final["usage"]["output_tokens"]) == responses_answer(want)
    assert effective(final["sampling"]) == effective(want.sampling)
    assert_disaggregated(final["sampling"])
    assert_idle(pd)


# ---- Messages ----


def message_answer(message) -> tuple[str | None, list[str], int]:
    return message.stop_reason, [b.text for b in message.content], message.usage.output_tokens


def prompt_tokens(usage) -> int:
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, SEEDED], ids=["greedy", "seeded"])
def test_messages_through_the_router_equal_a_single_server(pd, single, sampling):
    ask = {"model": "m", "max_tokens": 12, "messages": MESSAGES, "extra_body": sampling}
    want = claude(single.url).messages.create(**ask)
    assert want.usage.output_tokens > 0
    assert effective(want.sampling)["seed"] == sampling.get("seed")
    routed = claude(pd.router_url)
    whole = routed.messages.create(**ask)
    with routed.messages.stream(**ask) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    delta = next(e for e in events if e.type == "message_delta")
    for got in (whole, streamed):
        assert message_answer(got) == message_answer(want)
        assert effective(got.sampling) == effective(want.sampling)
        assert_disaggregated(got.sampling)
    prompt = prompt_tokens(want.usage)  # Anthropic's input_tokens leaves out cached ones
    assert prompt_tokens(whole.usage) == prompt_tokens(delta.usage) == prompt
    assert effective(delta.sampling) == effective(want.sampling)  # the finishing event's
    assert_idle(pd)


# ---- token counts ----


def test_token_counts(pd, single):
    """count_tokens goes through the router (to one worker, as sent); input_tokens is smg's
    405, and each half counts it alike when asked directly."""
    body = {"model": "m", "messages": MESSAGES, "system": "Be brief."}
    want = claude(single.url).messages.count_tokens(**body).input_tokens
    assert claude(pd.router_url).messages.count_tokens(**body).input_tokens == want

    body = {"model": "m", "input": "The quick brown fox", "instructions": "Be brief."}
    path = "/v1/responses/input_tokens"
    want = httpx.post(f"{single.url}{path}", json=body, timeout=HANG_GUARD_S).json()
    assert want["object"] == "response.input_tokens" and want["input_tokens"] > 0
    routed = httpx.post(f"{pd.router_url}{path}", json=body, timeout=HANG_GUARD_S)
    assert routed.status_code == 405  # smg's own: POST /v1/responses/{id} is no route of it
    for half in (pd.prefill, pd.decode):
        assert httpx.post(f"{half.url}{path}", json=body, timeout=HANG_GUARD_S).json() == want


def test_a_body_the_prefill_refuses_ends_the_decodes_wait_at_once(pd):
    """A second turn by previous_response_id: only the decode stored the first (the prefill's
    answer is its handoff), so the prefill refuses it before it runs anything, and tells the
    waiting decode, which answers then rather than at its --disaggregation-timeout."""
    _, first = direct(pd, "/v1/responses", {"model": "m", "input": "Hi", "max_output_tokens": 2})
    follow = {"model": "m", "input": "And?", "previous_response_id": first.json()["id"]}
    prefill, decode = both_halves(pd, "/v1/responses", follow)
    assert prefill.status_code == 404, prefill.text
    assert decode.status_code >= 400 and "404" in decode.text, decode.text
    assert decode.elapsed.total_seconds() < 5, decode.elapsed
    assert_idle(pd)


def test_verify_through_smg_names_the_values_the_router_set(pd, capsys):
    """smg writes top_k, min_p and repetition_penalty into a Responses body that left them out:
    the servers see them as sent by the request, and `verify` says so (chat: nothing added)."""
    from thermostat.cli import main

    base = ["verify", pd.router_url, "--max-tokens", "8", "--json"]
    main([*base, "--endpoint", "responses"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["provenance"]["status"] == "warn"
    for name in SMG_RESPONSES_DEFAULTS:
        assert name in checks["provenance"]["detail"]
    main([*base, "--endpoint", "chat"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["provenance"]["status"] == "pass"
