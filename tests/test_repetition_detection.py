"""vLLM's per-request `repetition_detection` (thermostat/sampling/repetition_detection.py): the
rule against vLLM's, and a served generation that loops ended with vLLM's finish reason."""

from __future__ import annotations

import httpx
import pytest

from tests.server_utils import running_server
from thermostat import LLM, SamplingParams
from thermostat.engine.loader import DEMO_MODEL_DIR
from thermostat.sampling import SamplingParamError
from thermostat.sampling.repetition_detection import RepetitionDetection


def test_a_tail_repeated_min_count_times_is_found():
    rule = RepetitionDetection(max_pattern_size=3, min_pattern_size=2, min_count=3)
    assert rule.found([9, 1, 2, 1, 2, 1, 2])  # "1 2" three times
    assert not rule.found([1, 2, 1, 2])  # twice
    assert not rule.found([5, 5, 5, 5])  # a 1-token pattern is below min_pattern_size
    assert rule.found([7, 4, 5, 6, 4, 5, 6, 4, 5, 6])
    assert not RepetitionDetection(0).found([1] * 50)  # off


@pytest.mark.parametrize(
    "body,param",
    [
        ({"max_pattern_size": 4, "min_count": 1}, "repetition_detection.min_count"),
        ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2},
         "repetition_detection.min_pattern_size"),
        ({"max_pattern_size": -1}, "repetition_detection.max_pattern_size"),
        ({"max_pattern_size": 4, "min_count": 2, "window": 9}, "repetition_detection.window"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_by_name(body, param):
    with pytest.raises(SamplingParamError) as info:
        RepetitionDetection.of(body)
    assert info.value.param == param


def test_a_looping_generation_ends_with_vllms_reason():
    rule = RepetitionDetection(max_pattern_size=8, min_pattern_size=1, min_count=4)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    llm = LLM("demo")
    looping = llm.generate(["My lord,"], params)[0]
    assert looping.finish_reason == "length"
    stopped = llm.generate(["My lord,"], SamplingParams(**params.sent(), repetition_detection=rule))
    out = stopped[0]
    assert (
        out.finish_reason == "repetition"
        and out.completions[0].stop_reason == "repetition_detected"
    )
    assert out.token_ids == looping.token_ids[: len(out.token_ids)] and rule.found(out.token_ids)
    assert not rule.found(out.token_ids[:-1])  # ended on the first token that completed it


def test_every_generation_api_takes_it():
    rule = {"max_pattern_size": 32, "min_pattern_size": 1, "min_count": 3}
    with running_server(DEMO_MODEL_DIR) as server:
        body = {"model": "demo", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "repetition_detection": rule}  # fmt: skip
        chat = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=120,
            json=body | {"messages": [{"role": "user", "content": "My lord,"}]},
        )
        done = httpx.post(server.url + "/v1/completions", json=body | {"prompt": "My lord,"},
                          timeout=120)  # fmt: skip
        for r in (chat, done):
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "repetition"
        bad = httpx.post(
            server.url + "/v1/completions",
            timeout=60,
            json=body | {"prompt": "x", "repetition_detection": {"min_count": -2}},
        )
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "repetition_detection.min_count"
        message = {"model": "demo", "max_tokens": 200, "temperature": 0,
                   "messages": [{"role": "user", "content": "My lord,"}],
                   "repetition_detection": rule}  # fmt: skip
        r = httpx.post(server.url + "/v1/messages", json=message, timeout=120)
        assert r.status_code == 200, r.text
