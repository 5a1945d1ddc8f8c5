"""The layered resolution contract of DESIGN.md, and generation_config.json reading."""

from __future__ import annotations

import json

import pytest

from thermostat.sampling import (
    GreedyRejected,
    Policy,
    SamplingDefaults,
    SamplingParamError,
    SamplingParams,
    resolve,
)
from thermostat.sampling.defaults import build_sampling_defaults
from thermostat.sampling.generation_config import read_generation_config

CASE_FILE = {"temperature": 1.0, "top_p": 1.0}  # the generic values the case's model carried


def test_omitted_fields_come_from_the_model_file_then_builtin():
    res = resolve(SamplingParams(), SamplingDefaults(generation_config={"temperature": 0.6}))
    assert res.effective.temperature == 0.6
    assert res.source["temperature"] == "generation_config"
    assert res.source["top_p"] == "builtin" and res.effective.top_p == 1.0
    assert res.effective.top_k == -1 and res.adjusted == ()


def test_request_wins_and_explicit_default_value_is_still_the_request():
    defaults = SamplingDefaults(operator={"temperature": 0.7}, generation_config=CASE_FILE)
    res = resolve(SamplingParams(temperature=1.0), defaults)
    assert res.effective.temperature == 1.0 and res.source["temperature"] == "request"
    res = resolve(SamplingParams(temperature=0.0), defaults)
    assert res.effective.greedy and res.source["temperature"] == "request"


def test_operator_beats_model_file():
    """The case's --preferred-sampling-params failure must be impossible."""
    defaults = SamplingDefaults(
        operator={"temperature": 0.6, "top_p": 0.95}, generation_config=CASE_FILE
    )
    res = resolve(SamplingParams(), defaults)
    assert (res.effective.temperature, res.effective.top_p) == (0.6, 0.95)
    assert res.source["temperature"] == res.source["top_p"] == "operator"


def test_recommended_sits_between_operator_and_model_file():
    defaults = SamplingDefaults(
        operator={"top_p": 0.9},
        recommended={"temperature": 0.6, "top_p": 0.95, "top_k": 20},
        generation_config=CASE_FILE | {"top_k": 50},
    )
    res = resolve(SamplingParams(), defaults)
    assert res.source == res.source | {
        "temperature": "recommended",
        "top_p": "operator",
        "top_k": "recommended",
    }


def test_recommended_needs_a_known_family():
    defaults = build_sampling_defaults({}, {"model_type": "qwen3"}, "recommended", Policy())
    assert defaults.recommended["top_k"] == 20
    with pytest.raises(ValueError, match="recommendation"):
        build_sampling_defaults({}, {"model_type": "gpt2"}, "recommended", Policy())


def test_min_temperature_raises_explicit_zero_and_records_it():
    defaults = SamplingDefaults(policy=Policy(min_temperature=0.3))
    res = resolve(SamplingParams(temperature=0.0), defaults)
    assert res.effective.temperature == 0.3
    assert [vars(a) for a in res.adjusted] == [
        {"param": "temperature", "requested": 0.0, "applied": 0.3, "policy": "min_temperature"}
    ]
    assert resolve(SamplingParams(temperature=0.5), defaults).adjusted == ()
    assert res.to_dict()["adjusted"][0]["policy"] == "min_temperature"


def test_greedy_reject_refuses_only_an_explicit_zero():
    defaults = SamplingDefaults(policy=Policy(greedy="reject"))
    with pytest.raises(GreedyRejected, match="--greedy reject"):
        resolve(SamplingParams(temperature=0.0), defaults)
    assert resolve(SamplingParams(temperature=0.2), defaults).effective.temperature == 0.2
    operator_greedy = SamplingDefaults(
        operator={"temperature": 0.0}, policy=Policy(greedy="reject")
    )
    assert resolve(SamplingParams(), operator_greedy).effective.greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", 1.1),
        ("n", 0),
        ("max_tokens", -1),
        ("logprobs", -1),
        ("presence_penalty", 3.0),
        ("repetition_penalty", 0.0),
        ("stop", [""]),
    ],
)
def test_bad_values_name_the_parameter(field, value):
    with pytest.raises(SamplingParamError) as info:
        resolve(SamplingParams(**{field: value}), SamplingDefaults())
    assert info.value.param == field


def test_generation_config_reads_only_keys_the_file_sets(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {"temperature": 0.6, "top_k": 0, "do_sample": False, "top_p": 7, "eos_token_id": [2, 3]}
        )
    )
    gen = read_generation_config(tmp_path)
    assert gen.values == {"temperature": 0.6, "top_k": -1}  # no top_k=50 invented
    assert gen.do_sample is False and gen.eos_token_ids == (2, 3)
    assert "top_p" in gen.ignored
    assert read_generation_config(tmp_path / "missing").values == {}
