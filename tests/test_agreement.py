"""One source of truth: what an HTTP response reports as applied, what the Python API reports and
what the engine ran agree, for the cases where a value is decided late (a max_tokens fitted to
the context, n samples with their seeds, a stop string, --stop-on-loop).

The bundled demo model (it loops under greedy decoding) is served with a short context so that
an omitted max_tokens must be fitted; the Python API gets the same engine settings.
"""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from tests.server_utils import KV_GB, running_server
from thermostat import LLM, SamplingParams
from thermostat.engine.loader import DEMO_MODEL_DIR

CONTEXT = 96
SETTINGS = dict(max_model_len=CONTEXT, stop_on_loop=True, kv_cache_memory_gb=KV_GB)


@pytest.fixture(scope="module")
def server():
    with running_server(DEMO_MODEL_DIR, **SETTINGS) as s:
        yield s


@pytest.fixture(scope="module")
def llm():
    return LLM("demo", **SETTINGS)


def complete(server, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "demo"} | body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(server, **body) -> tuple[dict[int, str], dict[int, dict]]:
    """Text per choice, and per choice the chunk that finished it."""
    texts: dict[int, str] = {}
    finals: dict[int, dict] = {}
    payload = {"model": "demo", "stream": True} | body
    with httpx.stream("POST", f"{server.url}/v1/completions", json=payload, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            for choice in chunk["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                if choice["finish_reason"] is not None:
                    finals[choice["index"]] = chunk
    return texts, finals


def test_an_omitted_max_tokens_is_the_room_the_prompt_leaves(server, llm):
    prompt = llm.tokenizer.encode("ROMEO. " * 40)[: CONTEXT - 16]
    room = CONTEXT - len(prompt)
    body = dict(prompt=prompt, temperature=0.8, seed=3, ignore_eos=True)
    params = SamplingParams(temperature=0.8, seed=3, ignore_eos=True)

    r = complete(server, **body)
    out = llm.generate([prompt], params)[0]
    queued = llm.engine.add_group("probe", llm.engine.plan([prompt], params))
    running = llm.engine.scheduler.requests[queued[0].req_id].params  # what the engine runs
    llm.engine.abort(queued[0].req_id)

    assert r["sampling"]["effective"]["max_tokens"] == room
    assert r["sampling"]["source"]["max_tokens"] == "context_length"
    assert r["sampling"]["adjusted"] == []
    assert r["sampling"] == out.sampling == queued[0].resolution.to_dict()
    assert running == queued[0].resolution.effective
    assert r["usage"]["completion_tokens"] == len(out.token_ids) == room  # what was applied
    assert r["choices"][0]["text"] == out.text
    assert r["choices"][0]["finish_reason"] == out.finish_reason == "length"
    texts, finals = streamed(server, **body)
    assert texts[0] == out.text and finals[0]["sampling"] == out.sampling


def test_an_operator_max_tokens_caps_omitted_ones_and_is_fitted_to_the_room():
    capped = LLM("demo", sampling_defaults={"max_tokens": 24}, **SETTINGS)
    params = SamplingParams(temperature=0.8, seed=3, ignore_eos=True)
    short = capped.generate(["My lord"], params)[0]
    assert short.sampling["effective"]["max_tokens"] == 24 == len(short.token_ids)
    assert short.sampling["source"]["max_tokens"] == "operator"
    assert short.sampling["adjusted"] == []

    prompt = capped.tokenizer.encode("ROMEO. " * 40)[: CONTEXT - 16]
    fitted = capped.generate([prompt], params)[0]
    assert fitted.sampling["effective"]["max_tokens"] == 16 == len(fitted.token_ids)
    assert fitted.sampling["source"]["max_tokens"] == "operator"
    assert fitted.sampling["adjusted"] == [
        {"param": "max_tokens", "requested": 24, "applied": 16, "policy": "context_length"}
    ]
    sent = capped.generate(["My lord"], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert sent.sampling["source"]["max_tokens"] == "request" and len(sent.token_ids) == 40


def test_a_sent_max_tokens_that_does_not_fit_is_refused_and_changes_nothing(server, llm):
    prompt = llm.tokenizer.encode("ROMEO. " * 40)[: CONTEXT - 8]
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "demo", "prompt": prompt, "max_tokens": 9},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    with pytest.raises(ValueError, match="context length"):
        llm.generate([prompt], SamplingParams(max_tokens=9))
    full = llm.tokenizer.encode("ROMEO. " * 80)[:CONTEXT]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "demo", "prompt": full})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"] == (
        f"prompt: {CONTEXT} tokens leave no room to generate in the context length ({CONTEXT})"
    )
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "demo", "prompt": full * 2})
    assert r.json()["error"]["message"] == (
        f"prompt: {2 * CONTEXT} tokens exceed the context length ({CONTEXT})"
    )
    assert not llm.engine.has_unfinished() and not server.engine.has_unfinished()


def test_n_samples_report_the_seed_each_ran_with(server, llm):
    body = dict(prompt="My lord, I have news", n=3, seed=11, temperature=0.9, max_tokens=12)
    r = complete(server, **body)
    params = SamplingParams(n=3, seed=11, temperature=0.9, max_tokens=12)
    out = llm.generate(["My lord, I have news"], params)[0]
    alone = [
        llm.generate(["My lord, I have news"], dataclasses.replace(params, n=1, seed=11 + j))[0]
        for j in range(3)
    ]
    texts, finals = streamed(server, **body)
    for j, choice in enumerate(r["choices"]):
        assert choice["text"] == out.completions[j].text == alone[j].text == texts[j]
        applied = choice.get("sampling", r["sampling"])  # choice 0's is the response's
        assert applied["effective"]["seed"] == 11 + j
        assert applied == alone[j].sampling == finals[j]["sampling"]
    assert r["sampling"] == out.sampling
    assert len({c["text"] for c in r["choices"]}) > 1


def test_a_stop_string_ends_the_same_generation_everywhere(server, llm):
    greedy = llm.generate(["ROMEO."], SamplingParams(temperature=0, max_tokens=40))[0]
    stop = greedy.text[10:14]
    assert len(stop) == 4
    body = dict(prompt="ROMEO.", temperature=0, max_tokens=40, stop=[stop])
    r = complete(server, **body)
    out = llm.generate(["ROMEO."], SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[0]
    choice = r["choices"][0]
    assert choice["text"] == out.text == greedy.text[: greedy.text.index(stop)]
    assert choice["finish_reason"] == out.finish_reason == "stop"
    assert choice["stop_reason"] == out.completions[0].stop_reason == stop
    assert r["usage"]["completion_tokens"] == len(out.token_ids) < 40
    texts, finals = streamed(server, **body)
    assert texts[0] == out.text and finals[0]["choices"][0]["stop_reason"] == stop


def test_stop_on_loop_ends_the_same_generation_everywhere(server, llm):
    prompt = "[Enter a Messenger.]\n\n[Enter a Messenger.]\n\n"  # a loop greedy carries on
    r = complete(server, prompt=prompt, temperature=0, max_tokens=80)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=80))[0]
    choice = r["choices"][0]
    assert choice["stop_reason"] == out.completions[0].stop_reason == "loop"
    assert choice["finish_reason"] == out.finish_reason == "stop"
    assert choice["text"] == out.text
    assert r["usage"]["completion_tokens"] == len(out.token_ids) < 80
    assert r["sampling"] == out.sampling
