"""A prefill and a decode server speaking the router's contract directly (the same body to both
at once, bootstrap fields added, as smg does): the decode's answer equals a single server's, and
every way the pair can disagree or fail ends in a clean error. tests/test_pd_smg.py runs the same
topology behind the real router."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.conftest import write_model
from tests.server_utils import RunningServer, running_server
from tests.waiting import HANG_GUARD_S

PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("pd"), "llama", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def single(model_dir):
    with running_server(model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def pair(model_dir):
    with (
        running_server(
            model_dir, disaggregation_mode="prefill", bootstrap_port=0, block_size=16
        ) as prefill,
        running_server(model_dir, disaggregation_mode="decode", block_size=4) as decode,
    ):
        yield prefill, decode


def bootstrap_port(prefill: RunningServer) -> int:
    role = prefill.state.role
    assert role is not None and hasattr(role, "server")
    return int(role.server.port)


def with_rooms(body: dict[str, Any], prefill: RunningServer, choices: int) -> dict[str, Any]:
    rooms = [random.randrange(2**63) for _ in range(choices)]
    port = bootstrap_port(prefill)
    if choices == 1:
        return body | {
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port,
            "bootstrap_room": rooms[0],
        }
    return body | {
        "bootstrap_host": ["127.0.0.1"] * choices,
        "bootstrap_port": [port] * choices,
        "bootstrap_room": rooms,
    }


async def _both(prefill_url: str, decode_url: str, path: str, body: dict[str, Any]):
    async with httpx.AsyncClient(timeout=HANG_GUARD_S) as client:
        return await asyncio.gather(
            client.post(f"{prefill_url}{path}", json=body),
            client.post(f"{decode_url}{path}", json=body),
        )


def pd_post(
    prefill: RunningServer, decode: RunningServer, path: str, body: dict[str, Any], choices: int = 1
) -> tuple[httpx.Response, httpx.Response]:
    """POST the body to both halves at once, as the router does; (prefill, decode) responses."""
    full = with_rooms(body, prefill, choices)
    p, d = asyncio.run(_both(prefill.url, decode.url, path, full))
    return p, d


def single_post(single: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{single.url}{path}", json=body, timeout=HANG_GUARD_S)


def texts(response: httpx.Response) -> list[str]:
    data = response.json()
    return [c.get("text", c.get("message", {}).get("content")) for c in data["choices"]]


def stream_text(response: httpx.Response) -> str:
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(out)


def kv_usage(server: RunningServer) -> float:
    return server.engine.blocks.usage


@pytest.mark.parametrize(
    ("path", "body", "choices"),
    [
        ("/v1/completions", {"prompt": PROMPT} | GREEDY, 1),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]} | GREEDY, 1),
        ("/v1/completions", {"prompt": [PROMPT, "Another prompt"]} | GREEDY, 2),
        (
            "/v1/completions",
            {"prompt": PROMPT, "temperature": 0.5, "seed": 3, "n": 3, "max_tokens": 10},
            3,
        ),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 2, "echo": True} | GREEDY, 1),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "JSON please"}],
                "response_format": {"type": "json_object"},
                "temperature": 0.0,
                "max_tokens": 40,
            },
            1,
        ),
    ],
    ids=["completions", "chat", "two-prompts", "seeded-n3", "logprobs-echo", "json-object"],
)
def test_decode_answers_as_a_single_server(pair, single, path, body, choices):
    prefill, decode = pair
    p, d = pd_post(prefill, decode, path, body, choices)
    assert p.status_code == 200, p.text
    assert d.status_code == 200, d.text
    expected = single_post(single, path, body)
    assert texts(d) == texts(expected)
    got, want = d.json(), expected.json()
    if body.get("logprobs"):
        assert got["choices"][0]["logprobs"] == want["choices"][0]["logprobs"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    sampling = got["sampling"]
    assert sampling["effective"] == want["sampling"]["effective"]
    assert sampling["disaggregation"]["agreed"] == ["model", "kv_cache", "prompt", "sampling"]
    assert p.json()["object"] == "prefill"
    assert kv_usage(prefill) == 0.0 and kv_usage(decode) == 0.0


def test_streaming_decode_equals_single(pair, single):
    prefill, decode = pair
    body = {"prompt": PROMPT, "stream": True} | GREEDY
    p, d = pd_post(prefill, decode, "/v1/completions", body)
    assert p.status_code == 200 and d.status_code == 200
    expected = single_post(single, "/v1/completions", body | {"stream": False})
    assert stream_text(d) == texts(expected)[0]
    assert d.text.rstrip().endswith("data: [DONE]")


def test_int8_fp8_pair_equals_int8_fp8_single(model_dir):
    """int8 weights and an fp8 cache on both halves (the quantized deployment) hand off exactly."""
    fp8_pair_equals_fp8_single(model_dir, quantization="int8")


def test_deepseek_v4_fp8_pair_equals_fp8_single(tmp_path):
    """The case's deployment on its own architecture: window rows, entries, index keys (fp8) and
    compressor state hand off between a prefill and a decode server of other block sizes."""
    fp8_pair_equals_fp8_single(write_model(tmp_path / "v4", "deepseek_v4"))


def fp8_pair_equals_fp8_single(model_dir: Path, **extra: Any) -> None:
    options = {"kv_cache_dtype": "fp8_e4m3", **extra}
    with (
        running_server(model_dir, **options) as single,
        running_server(
            model_dir, disaggregation_mode="prefill", bootstrap_port=0, block_size=16, **options
        ) as p,
        running_server(model_dir, disaggregation_mode="decode", block_size=4, **options) as d,
    ):
        body = {"prompt": PROMPT} | GREEDY
        _, got = pd_post(p, d, "/v1/completions", body)
        assert got.status_code == 200, got.text
        assert texts(got) == texts(single_post(single, "/v1/completions", body))
        assert got.json()["sampling"]["disaggregation"]["kv_cache"]["components"][0]["dtype"] == (
            "torch.float8_e4m3fn"
        )
        formats = {
            httpx.get(f"{s.url}/server_info", timeout=10).json()["weight_format"]
            for s in (p, d, single)
        }
        assert len(formats) == 1
        assert extra.get("quantization", next(iter(formats))) in formats


def test_a_speculating_decode_answers_as_a_single_server(model_dir, pair, single):
    """--speculative on the decode half: the continuation is the single server's, token for
    token and logprob for logprob (greedy, and seeded sampling: the handed-over generator draws
    as without speculation), and the response says what speculation did."""
    prefill, _ = pair
    prompt = [5, 17, 42, 99, 3, 250, 7, 5, 17, 42, 99, 3]  # token ids: text that repeats
    greedy = {"prompt": prompt, "logprobs": 2} | GREEDY | {"max_tokens": 24}
    seeded = greedy | {"temperature": 0.8, "seed": 11}
    with running_server(
        model_dir, disaggregation_mode="decode", block_size=4, speculative="ngram"
    ) as decode:
        for body in (greedy, seeded):
            p, d = pd_post(prefill, decode, "/v1/completions", body)
            assert p.status_code == 200 and d.status_code == 200, d.text
            want = single_post(single, "/v1/completions", body).json()
            got = d.json()
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            assert got["choices"][0]["logprobs"] == want["choices"][0]["logprobs"]
            assert got["sampling"]["speculative"]["proposed"] > 0


def test_halves_with_other_sampling_defaults_are_refused(model_dir, pair):
    _, decode = pair
    with running_server(
        model_dir,
        disaggregation_mode="prefill",
        bootstrap_port=0,
        sampling_defaults={"top_p": 0.9},
    ) as other:
        p, d = pd_post(other, decode, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert p.status_code == 200
    assert d.status_code == 409
    error = d.json()["error"]
    assert error["code"] == "pd_mismatch"
    assert "top_p: prefill 0.9 (operator), decode 1.0" in error["message"]
    assert kv_usage(decode) == 0.0
    facts = httpx.get(decode.url + "/v1/console/state").json()["facts"]  # the console says so
    assert facts["role"] == "decode" and facts["last handoff"]["outcome"] == "pd_mismatch"
    assert "top_p" in facts["last handoff"]["message"]
    p, d = pd_post(*pair, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert d.status_code == 200
    facts = httpx.get(decode.url + "/v1/console/state").json()["facts"]
    assert facts["last handoff"]["outcome"] == "agreed"
    assert facts["last prefill"] == f"127.0.0.1:{bootstrap_port(pair[0])}"


def test_halves_with_other_kv_dtype_are_refused(model_dir, pair):
    _, decode = pair
    with running_server(
        model_dir, disaggregation_mode="prefill", bootstrap_port=0, kv_cache_dtype="fp8_e4m3"
    ) as other:
        _, d = pd_post(other, decode, "/v1/completions", {"prompt": PROMPT} | GREEDY)
    assert d.status_code == 409 and "KV cache" in d.json()["error"]["message"]


def test_halves_with_other_weight_formats_are_refused(model_dir, pair):
    _, decode = pair
    with running_server(
        model_dir, disaggregation_mode="prefill", bootstrap_port=0, quantization="int8"
    ) as other:
        _, d = pd_post(other, decode, "/v1/completions", {"prompt": PROMPT} | GREEDY)
    assert d.status_code == 409
    message = d.json()["error"]["message"]
    assert "'weight_format': 'int8'" in message and "'weight_format': 'bfloat16'" in message


def test_a_room_that_never_comes_times_out(model_dir, pair):
    """A decode of its own with a 1 s wait: the pair's decode waits its default 60 s, a hang
    guard for the rooms that do come."""
    prefill, _ = pair
    body = with_rooms({"prompt": PROMPT} | GREEDY, prefill, 1)  # the prefill never gets it
    with running_server(model_dir, disaggregation_mode="decode", disaggregation_timeout_s=1) as d:
        response = httpx.post(f"{d.url}/v1/completions", json=body, timeout=HANG_GUARD_S)
        usage = kv_usage(d)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "prefill_timeout"
    assert usage == 0.0


def test_no_prefill_listening_is_a_clean_502(pair, single):
    _, decode = pair
    body = {"prompt": PROMPT, "bootstrap_host": "127.0.0.1", "bootstrap_port": 1}
    response = httpx.post(f"{decode.url}/v1/completions", json=body | {"bootstrap_room": 7})
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "prefill_unreachable"


def test_a_refused_prefill_is_reported_by_the_decode(pair):
    prefill, decode = pair
    body = {"prompt": PROMPT, "temperature": -1.0}  # both refuse it: the decode says why itself
    p, d = pd_post(prefill, decode, "/v1/completions", body)
    assert p.status_code == 400 and d.status_code == 400
    body = {"prompt": PROMPT, "max_tokens": 5000}  # over the context: both refuse
    p, d = pd_post(prefill, decode, "/v1/completions", body)
    assert p.status_code == 400 and d.status_code == 400


@pytest.mark.parametrize("server", ["prefill", "decode"])
def test_requests_without_rooms_are_refused(pair, server):
    target = pair[0] if server == "prefill" else pair[1]
    response = httpx.post(f"{target.url}/v1/completions", json={"prompt": PROMPT})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "bootstrap_room"


def test_worker_contract_routes(pair):
    prefill, decode = pair
    info = httpx.get(f"{prefill.url}/server_info").json()
    assert info["disaggregation_mode"] == "prefill" and info["max_running_requests"] >= 1
    assert httpx.get(f"{decode.url}/get_server_info").json()["disaggregation_mode"] == "decode"
    model = httpx.get(f"{decode.url}/get_model_info").json()
    assert model["architectures"] == ["LlamaForCausalLM"] and model["is_generation"] is True
    assert httpx.get(f"{decode.url}/model_info").json() == model
    load = httpx.get(f"{decode.url}/get_load").json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    assert httpx.post(f"{decode.url}/flush_cache").json()["flushed"] is True
    assert httpx.get(f"{decode.url}/version").status_code == 404  # smg: an SGLang worker
    metrics = httpx.get(f"{prefill.url}/metrics").text
    assert 'thermostat_disagg_handoffs_total{outcome="ok",role="prefill"}' in metrics
