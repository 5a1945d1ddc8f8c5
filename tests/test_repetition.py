"""DRY and XTC (thermostat/engine/repetition.py) against plain references, and through the
server: accepted on every API, resolved with a source, settable as operator defaults, refused by
a gateway whose upstream lacks them."""

from __future__ import annotations

import math
import random

import httpx
import pytest
import torch

from tests.server_utils import running_server
from thermostat import LLM, SamplingParams
from thermostat.engine.loader import DEMO_MODEL_DIR
from thermostat.engine.repetition import (
    BreakerTokens,
    apply_xtc,
    dry_penalties,
    xtc_coins,
)
from thermostat.engine.sampler import sample_batch
from thermostat.gateway.kinds import KINDS


def naive_dry(context, breakers, multiplier, base, allowed):
    """Every earlier place, every length, compared token by token."""
    last = len(context) - 1
    longest: dict[int, int] = {}
    for end in range(last):  # a repeat ending at context[end], followed by context[end + 1]
        n = 0
        while end - n >= 0 and context[last - n] not in breakers:
            if context[end - n] != context[last - n]:
                break
            n += 1
        if n >= allowed:
            token = context[end + 1]
            longest[token] = max(longest.get(token, 0), n)
    return {t: multiplier * base ** (n - allowed) for t, n in longest.items()}


def test_dry_penalises_the_token_that_would_extend_a_repeat():
    # "5 6" was followed by 7; the context ends in "5 6": 7 would make the repeat 3 long
    assert dry_penalties([5, 6, 7, 9, 5, 6], frozenset(), 0.8, 1.75, 2) == {7: 0.8}
    # one repeated token is below the allowed length; a breaker (6) stops the match
    assert dry_penalties([5, 6, 7, 9, 5, 6], frozenset(), 0.8, 1.75, 3) == {}
    assert dry_penalties([5, 6, 7, 9, 5, 6], frozenset({6}), 0.8, 1.75, 2) == {}
    # a loop: the longer the repeat, the larger the penalty (base ** (n - allowed))
    loop = [1, 2, 3] * 4
    got = dry_penalties(loop, frozenset(), 1.0, 2.0, 2)
    assert got == {1: 2.0 ** (len(loop) - 3 - 2)}
    assert math.isfinite(dry_penalties([4] * 5000, frozenset(), 5.0, 3.0, 2)[4])  # capped


@pytest.mark.parametrize("seed", range(40))
def test_dry_equals_the_naive_reference(seed):
    rng = random.Random(seed)
    context = [rng.randrange(4) for _ in range(rng.randrange(2, 60))]
    breakers = frozenset({3}) if seed % 2 else frozenset()
    allowed = rng.randrange(1, 4)
    want = naive_dry(context, breakers, 0.7, 1.5, allowed)
    got = dry_penalties(context, breakers, 0.7, 1.5, allowed)
    assert got.keys() == want.keys()
    assert all(math.isclose(got[t], want[t]) for t in want)


def test_xtc_keeps_the_least_probable_of_the_top_choices():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.9, 0.05, 0.03, 0.02], [0.5, 0.3, 0.15, 0.05]])
    out = apply_xtc(
        probs,
        probability=torch.tensor([1.0, 1.0, 0.5]),
        threshold=torch.tensor([0.1, 0.1, 0.1]),
        coins=torch.tensor([0.3, 0.3, 0.7]),  # the last row's coin says no
    )
    assert out[0].tolist() == pytest.approx([0.0, 0.0, 0.15, 0.05])
    assert out[1].tolist() == pytest.approx(probs[1].tolist())  # one choice above: nothing
    assert out[2].tolist() == pytest.approx(probs[2].tolist())


def test_xtc_coins_are_the_seeds_and_positions_alone():
    first = xtc_coins([7, 7, None], [0, 1, 0])
    assert first[:2] == xtc_coins([7, 7], [0, 1]) and first[0] != first[1]
    assert all(0.0 <= c < 1.0 for c in first)


def test_xtc_in_the_sampler_never_draws_an_excluded_token():
    from tests.test_sampler import make_batch

    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 200))
    batch = make_batch(200, xtc_probability=1.0, xtc_threshold=0.15)
    drawn = sample_batch(logits, batch).token_ids
    assert set(drawn) <= {2, 3} and 2 in drawn  # 0.4 and 0.3 excluded; 0.2 kept
    greedy = make_batch(200, temperature=0.0, xtc_probability=1.0, xtc_threshold=0.15)
    assert set(sample_batch(logits, greedy).token_ids) == {0}  # argmax is argmax


def test_breaker_tokens_are_the_ids_whose_text_holds_one():
    texts = ["a", ":", "b\n", "c", '"x']
    tokens = BreakerTokens(lambda: texts)
    assert tokens.ids(("\n", ":", '"', "*")) == {1, 2, 4}
    assert tokens.ids(()) == frozenset()


def test_dry_on_the_demo_breaks_its_greedy_loop():
    """The demo model's greedy answer loops; with DRY it does not end in a loop."""
    from thermostat.quality import analyze

    llm = LLM("demo")
    greedy = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
    looping = llm.generate(["My lord,"], greedy)[0]
    assert analyze(looping.text).degenerate
    dry = llm.generate(["My lord,"], SamplingParams(**greedy.sent(), dry_multiplier=0.8))[0]
    assert dry.token_ids != looping.token_ids


def test_every_api_takes_dry_and_xtc_with_a_source_and_operator_defaults():
    from openai import OpenAI

    operator = {"dry_multiplier": 0.5, "xtc_threshold": 0.2}
    with running_server(DEMO_MODEL_DIR, sampling_defaults=operator) as server:
        url = server.url
        client = OpenAI(base_url=f"{url}/v1", api_key="x")
        chat = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "My lord"}],
            max_tokens=8,
            extra_body={"dry_base": 2.0, "dry_sequence_breakers": ["\n"], "xtc_probability": 0.3},
        )
        sampling = chat.model_extra["sampling"]
        assert sampling["effective"]["dry_multiplier"] == 0.5
        assert sampling["source"]["dry_multiplier"] == "operator"
        assert sampling["effective"]["dry_base"] == 2.0
        assert sampling["source"]["dry_base"] == "request"
        assert sampling["source"]["xtc_threshold"] == "operator"
        assert sampling["source"]["dry_allowed_length"] == "builtin"
        for path, body in (
            ("/v1/completions", {"prompt": "My lord"}),
            ("/v1/responses", {"input": "My lord"}),
            ("/v1/messages", {"messages": [{"role": "user", "content": "My lord"}]}),
        ):
            body = body | {"model": "demo", "max_tokens": 8, "dry_allowed_length": 3}
            if path == "/v1/responses":
                body["max_output_tokens"] = body.pop("max_tokens")
            r = httpx.post(url + path, json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["sampling"]["effective"]["dry_allowed_length"] == 3, path
        bad = httpx.post(
            url + "/v1/completions",
            json={"model": "demo", "prompt": "x", "max_tokens": 2, "dry_base": 1.0},
            timeout=60,
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "dry_base"


def test_a_gateway_refuses_dry_for_an_upstream_that_lacks_it():
    assert not KINDS["vllm"].supports("dry_multiplier")
    assert not KINDS["sglang"].supports("xtc_probability")
    assert KINDS["llamacpp"].supports("dry_sequence_breakers")
    assert KINDS["llamacpp"].wire("dry_multiplier", 0.8) == ("dry_multiplier", 0.8)
