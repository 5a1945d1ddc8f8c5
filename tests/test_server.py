"""End-to-end: a real server on loopback, talked to with the official openai client.

The model is the case study's: generation_config.json says temperature 0.6, top_p 0.95.
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
import torch

from tests.conftest import hf_model, write_model
from tests.server_utils import running_server
from tests.waiting import wait_until

CHAT = [{"role": "user", "content": "It was the best of times"}]
CASE_GENERATION_CONFIG = {"temperature": 0.6, "top_p": 0.95, "eos_token_id": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(
        tmp_path_factory.mktemp("case"), "llama", generation_config=CASE_GENERATION_CONFIG
    )


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def idle(server) -> bool:
    blocks = server.engine.blocks
    return not server.engine.has_unfinished() and blocks.num_free_blocks == blocks.num_blocks


def test_case_study_two_requests_omitting_temperature(server, client):
    """The case's check: requests that omit temperature sample with the model file's 0.6/0.95,
    so two of them differ; two with an explicit temperature 0 are identical."""
    extra = {"ignore_eos": True}
    sampled = [
        client.chat.completions.create(
            model=server.model, messages=CHAT, max_tokens=16, extra_body=extra
        )
        for _ in range(2)
    ]
    assert sampled[0].choices[0].message.content != sampled[1].choices[0].message.content
    for r in sampled:
        assert r.sampling["source"]["temperature"] == "generation_config"
        assert r.sampling["source"]["top_p"] == "generation_config"
        assert r.sampling["effective"]["temperature"] == 0.6
        assert r.sampling["effective"]["top_p"] == 0.95
        assert set(r.quality) >= {"degenerate", "signals", "reasons", "flags"}
        assert r.quality["signals"]["tokens"] > 0
    greedy = [
        client.chat.completions.create(
            model=server.model, messages=CHAT, max_tokens=16, temperature=0, extra_body=extra
        )
        for _ in range(2)
    ]
    assert greedy[0].choices[0].message.content == greedy[1].choices[0].message.content
    assert greedy[0].sampling["source"]["temperature"] == "request"
    assert greedy[0].sampling["effective"]["temperature"] == 0.0


def test_stream_agrees_with_non_stream(server, client):
    kwargs = dict(model=server.model, messages=CHAT, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1
    assert final[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert final[0].sampling == whole.sampling
    assert final[0].quality == whole.quality  # same text, same report
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    ckw = dict(model=server.model, prompt="It was the", max_tokens=10, temperature=0)
    whole_c = client.completions.create(**ckw)
    streamed = list(client.completions.create(**ckw, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole_c.choices[0].text
    assert streamed[-1].sampling == whole_c.sampling


def test_n_seed_stop_and_max_completion_tokens(server, client):
    def three_seeded():
        return client.chat.completions.create(
            model=server.model,
            messages=CHAT,
            n=3,
            seed=7,
            max_completion_tokens=6,
            extra_body={"ignore_eos": True},
        )

    r = three_seeded()
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 18 and r.sampling["effective"]["max_tokens"] == 6
    again = three_seeded()
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]

    greedy = dict(
        model=server.model, prompt="It was the", temperature=0, extra_body={"ignore_eos": True}
    )
    text = client.completions.create(**greedy, max_tokens=24).choices[0].text
    windows = (text[i : i + 3] for i in range(4, len(text) - 3))
    stop = next(w for w in windows if w.strip() == w and "\ufffd" not in w)
    cut = client.completions.create(**greedy, max_tokens=24, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]


def test_extra_body_fields_reach_the_resolution(server, client):
    r = client.completions.create(
        model=server.model,
        prompt="It was",
        max_tokens=3,
        extra_body={
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "stop_token_ids": [7],
        },
    )
    eff, src = r.sampling["effective"], r.sampling["source"]
    assert (eff["top_k"], eff["min_p"], eff["repetition_penalty"]) == (5, 0.1, 1.1)
    assert src["top_k"] == src["min_p"] == src["repetition_penalty"] == "request"
    assert src["frequency_penalty"] == "builtin"


def test_sixteen_concurrent_streams_finish(server):
    async def one(client, i: int) -> tuple[str, dict]:
        stream = await client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=8,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, final = "", None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.choices and chunk.choices[0].finish_reason:
                final = chunk
        return final.choices[0].finish_reason, final.sampling

    async def main():
        client = server.async_client()
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(main())
    assert len(results) == 16
    assert all(
        reason == "length" and sampling["effective"]["max_tokens"] == 8
        for reason, sampling in results
    )
    wait_until(lambda: idle(server), "the engine going idle")


def request_lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "thermostat.requests"]


def test_client_disconnect_aborts_and_frees_blocks(server, caplog):
    body = {"model": server.model, "prompt": "It was the", "max_tokens": 500, "ignore_eos": True}
    caplog.set_level(logging.INFO, logger="thermostat.requests")
    stream = body | {"stream": True}
    with (
        httpx.Client(base_url=server.url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=stream) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"text"' in line:
                break  # leave mid-stream
    wait_until(lambda: idle(server), "the stream's abort freeing the KV blocks")
    wait_until(lambda: len(request_lines(caplog)) == 1, "the aborted stream's request line")
    line = request_lines(caplog)[0]
    assert line["status"] == "aborted" and line["completion_tokens"] < 500

    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up waiting
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.2)
    wait_until(lambda: idle(server), "the non-stream abort freeing the KV blocks")
    wait_until(lambda: len(request_lines(caplog)) == 2, "the aborted request's request line")
    line = request_lines(caplog)[1]
    assert line["status"] == "aborted" and line["completion_tokens"] < 500
    server.engine.blocks.check_integrity()


def test_echo_logprobs_match_transformers(server, client, model_dir):
    """lm-evaluation-harness loglikelihood: max_tokens=0, echo, logprobs=1."""
    prompt = [5, 17, 42, 99, 3, 250, 7, 64, 3, 8, 150, 77, 31, 200, 201]
    r = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 0
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        logits = hf_model(model_dir)(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    for i in range(1, len(prompt)):
        assert abs(lp.token_logprobs[i] - expected[i - 1, prompt[i]].item()) < 1e-4
        assert abs(max(lp.top_logprobs[i].values()) - expected[i - 1].max().item()) < 1e-4
    assert choice.text == server.state.tokens.decode(prompt)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs_shape(server, client):
    r = client.chat.completions.create(
        model=server.model,
        messages=CHAT,
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0 and isinstance(item.bytes, list) and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.logprob


def test_sampling_defaults_and_explain(server):
    d = httpx.get(f"{server.url}/v1/sampling/defaults").json()
    assert d["model"] == server.model
    assert d["effective"]["temperature"] == 0.6 and d["effective"]["top_p"] == 0.95
    assert d["source"]["temperature"] == "generation_config"
    assert d["source"]["top_k"] == "builtin"
    assert d["policy"] == {"min_temperature": None, "greedy": "allow"}
    gen = d["generation_config"]
    assert gen["values"] == {"temperature": 0.6, "top_p": 0.95}
    assert gen["path"].endswith("generation_config.json") and gen["do_sample"] is None
    assert d["recommended"]["family"] == "llama" and d["recommended"]["applied"] is False
    assert isinstance(d["warnings"], list)

    chat = {"model": server.model, "messages": CHAT, "temperature": 0.3}
    e = httpx.post(f"{server.url}/v1/sampling/explain", json=chat).json()
    assert e["endpoint"] == "chat"
    assert e["sampling"]["effective"]["temperature"] == 0.3
    assert e["sampling"]["source"] == d["source"] | {"temperature": "request"}
    completion = {"prompt": "x", "top_p": 0.5}
    e = httpx.post(f"{server.url}/v1/sampling/explain", json=completion).json()
    assert e["endpoint"] == "completions" and e["sampling"]["source"]["top_p"] == "request"
    bad = httpx.post(f"{server.url}/v1/sampling/explain", json={"temperature": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"


def test_models_tokenize_detokenize_health(server):
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [server.model]
    tokenizer = server.state.prompts.tokenizer
    t = httpx.post(f"{server.url}/tokenize", json={"prompt": "It was the age"}).json()
    assert t["tokens"] == tokenizer.encode("It was the age") and t["count"] == len(t["tokens"])
    assert t["max_model_len"] == 512
    d = httpx.post(f"{server.url}/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == "It was the age"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > t["count"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_health_503_while_not_ready(server):
    state = server.state
    state.status = "draining"
    try:
        assert httpx.get(f"{server.url}/health").status_code == 503
        r = httpx.get(f"{server.url}/v1/models")
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    finally:
        state.status = "ready"
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_metrics_families(server, client):
    client.completions.create(model=server.model, prompt="It was", max_tokens=3, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    for family in (
        "thermostat_requests_total",
        "thermostat_prompt_tokens_total",
        "thermostat_generation_tokens_total",
        "thermostat_time_to_first_token_seconds",
        "thermostat_inter_token_latency_seconds",
        "thermostat_requests_running",
        "thermostat_requests_waiting",
        "thermostat_kv_cache_usage_ratio",
        "thermostat_prefix_cache_hit_rate",
        "thermostat_requests_by_temperature_source_total",
        "thermostat_greedy_requests_total",
        "thermostat_policy_adjustments_total",
        "thermostat_degenerate_responses_total",
    ):
        assert f"# TYPE {family} " in text, family
    assert 'thermostat_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'thermostat_requests_by_temperature_source_total{source="request"}' in text
    assert 'thermostat_requests_by_temperature_source_total{source="generation_config"}' in text


def test_bench_against_the_server(server, capsys):
    from thermostat.cli import main

    code = main(
        [
            "bench",
            server.url,
            "--num-requests",
            "6",
            "--concurrency",
            "3",
            "--prompt-tokens",
            "8",
            "--output-tokens",
            "4",
            "--json",
        ]
    )
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["completed"] == 6 and summary["errors"] == 0
    assert summary["output_tokens"] == 24 and summary["model"] == server.model
    assert summary["ttft_s"]["p50"] > 0 and summary["itl_s"]["p99"] >= summary["itl_s"]["p50"]


def test_usage_reports_prefix_cache_hits_and_reset_prefix_cache_forgets_them(server, client):
    """What load tools and eval harnesses read: cached_tokens (OpenAI's field) and vLLM's
    POST /reset_prefix_cache."""
    prompt = list(range(1, 70))  # four full blocks of 16 and a tail
    kwargs = dict(model=server.model, prompt=prompt, max_tokens=2, temperature=0)
    httpx.post(f"{server.url}/reset_prefix_cache", timeout=10)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 64
    reset = httpx.post(f"{server.url}/reset_prefix_cache", timeout=10)
    assert reset.status_code == 200 and reset.json()["blocks_dropped"] >= 4
    third = client.completions.create(**kwargs)
    assert third.usage.prompt_tokens_details.cached_tokens == 0
    assert third.choices[0].text == first.choices[0].text


def test_continuous_usage_stats_put_usage_on_every_chunk(server, client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(
            model=server.model,
            prompt="It was the",
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream=True,
            stream_options=options,
        )
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
    plain = list(
        client.completions.create(
            model=server.model, prompt="It was the", max_tokens=6, temperature=0, stream=True
        )
    )
    assert all(c.usage is None for c in plain)
