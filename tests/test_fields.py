"""The sampling field table (thermostat/sampling/fields.py) against everything derived from it or
declared beside it: adding a parameter must not be able to miss a place."""

from __future__ import annotations

import dataclasses
import math
import typing

import pydantic
import pytest

from thermostat.api.errors import classify
from thermostat.api.protocol import ChatCompletionRequest, CompletionRequest
from thermostat.api.request_params import parse_body, to_sampling_params
from thermostat.engine.sampler import _TORCH_DTYPES, SamplingBatch
from thermostat.sampling import (
    FIELDS,
    LAYERED_FIELDS,
    EffectiveParams,
    SamplingDefaults,
    SamplingParamError,
    SamplingParams,
    resolve,
)
from thermostat.sampling.fields import BATCH_FIELDS, BUILTIN, FIELD, INT64, SamplingField
from thermostat.sampling.params import validate_layered
from thermostat.sampling.spec import SpecError, parse_sampling_spec

NUMBERS = [f for f in FIELDS if f.type in (int, float)]
FLOATS = [f for f in FIELDS if f.type is float]
BODY = [f for f in FIELDS if f.body]


def ids(fields: list[SamplingField]) -> list[str]:
    return [f.name for f in fields]


def example(field: SamplingField):
    """A valid value of `field` other than its neutral one, as JSON would carry it."""
    if field.type is bool:
        return not field.neutral
    if field.type is str:
        return ["x"]
    if field.shape == "list":
        return [5]
    if field.type is int:
        return int(field.low.value) + 3 if field.low else 7
    middle = (field.low.value + field.high.value) / 2
    return middle if middle != field.neutral else field.low.value


def assert_refused(field: SamplingField, value) -> None:
    """Refused by SamplingParams and (for layered fields) validate_layered, as a 400 naming the
    field."""
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(**{field.name: value}).validate()
    assert info.value.param == field.name
    err = classify(info.value)
    assert err.status == 400 and err.info.param == field.name
    if field.layered:
        with pytest.raises(SamplingParamError):
            validate_layered(field.name, value)


# ---- the declarations match the table ----


# Not table fields: an object each, checked when built (sampling/structured.py)
OBJECT_FIELDS = ["structured", "repetition_detection"]


def test_sampling_params_declares_every_field_in_order_defaulting_to_none():
    declared = dataclasses.fields(SamplingParams)
    assert [f.name for f in declared] == ids(FIELDS) + OBJECT_FIELDS
    assert all(f.default is None for f in declared)
    assert SamplingParams().sent() == {}


def test_effective_params_declares_every_effective_field():
    declared = {f.name: f for f in dataclasses.fields(EffectiveParams)}
    assert set(declared) == {f.name for f in FIELDS if f.effective} | set(OBJECT_FIELDS)
    for field in FIELDS:
        if field.layered:  # always resolved: no default to fall back on
            assert declared[field.name].default is dataclasses.MISSING, field.name
        elif field.effective and field.neutral is not None:
            assert declared[field.name].default == field.neutral, field.name


def test_every_layered_field_has_a_valid_builtin():
    assert tuple(f.name for f in FIELDS if f.layered) == LAYERED_FIELDS
    assert set(BUILTIN) == set(LAYERED_FIELDS)
    for name, value in BUILTIN.items():
        assert value is not None and isinstance(value, FIELD[name].type), name
        validate_layered(name, value)
    assert resolve(SamplingParams(), SamplingDefaults()).source == dict.fromkeys(
        LAYERED_FIELDS, "builtin"
    ) | {"max_tokens": "context_length"}


def test_sampling_effective_keys_and_order_are_the_contract():
    effective = resolve(SamplingParams(), SamplingDefaults()).effective
    assert list(effective.sampling_dict()) == [
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "dry_multiplier",
        "dry_base",
        "dry_allowed_length",
        "dry_penalty_last_n",
        "xtc_probability",
        "xtc_threshold",
        "max_tokens",
        "seed",
    ]


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_request_models_have_every_body_field_optional_none(model):
    for field in BODY:
        info = model.model_fields[field.name]
        assert info.default is None and not info.is_required(), field.name
        assert type(None) in typing.get_args(info.annotation), field.name
    assert model.model_validate({"messages": [], "prompt": "x"}).model_fields_set <= {
        "messages",
        "prompt",
    }


def test_every_alias_is_a_field_of_some_request_model():
    for field in FIELDS:
        for alias in field.aliases:
            assert alias in ChatCompletionRequest.model_fields or (
                alias in CompletionRequest.model_fields
            )


def test_sampling_batch_has_a_typed_list_column_per_batch_field():
    hints = typing.get_type_hints(SamplingBatch)
    for field in BATCH_FIELDS:
        assert field.batch_dtype in _TORCH_DTYPES, field.name
        assert hints[field.name] == list[field.type], field.name
    params = [resolve(SamplingParams(top_k=5), SamplingDefaults()).effective] * 2
    rows = {"generators": [None] * 2, "prompt_ids": [[]] * 2, "output_ids": [[]] * 2}
    batch = SamplingBatch.of(params, **rows, banned_ids=[[]] * 2, num_logprobs=[None] * 2)
    assert batch.top_k == [5, 5] and batch.temperature == [1.0, 1.0]


# ---- the request body reaches SamplingParams through the table ----


@pytest.mark.parametrize("field", BODY, ids=ids(BODY))
def test_each_body_field_is_copied_to_its_sampling_params_field(field):
    value = example(field)
    field.check(value)
    for raw in ({field.name: value}, {"prompt": "x", field.name: value}):
        assert to_sampling_params(parse_body(raw)).sent() == {field.name: value}


def test_endpoint_shaped_fields_reach_sampling_params():
    chat = to_sampling_params(parse_body({"logprobs": True, "top_logprobs": 2}))
    assert chat.logprobs == 2 and chat.prompt_logprobs is None
    legacy = to_sampling_params(parse_body({"prompt": "x", "logprobs": 3, "echo": True}))
    assert legacy.logprobs == 3 and legacy.prompt_logprobs == 3
    alias = to_sampling_params(parse_body({"max_tokens": 5, "max_completion_tokens": 9}))
    assert alias.max_tokens == 9


def wrong_json_type(field: SamplingField):
    """A JSON value of the wrong type: strict models never coerce it."""
    return {float: "0.5", int: 2.0, bool: 1, str: 5}[field.type]


@pytest.mark.parametrize("field", BODY, ids=ids(BODY))
def test_request_models_are_strict(field):
    value = wrong_json_type(field)
    if field.shape == "list":
        value = [value]
    with pytest.raises(pydantic.ValidationError) as info:
        parse_body({field.name: value})
    assert info.value.errors()[0]["loc"][0] == field.name


@pytest.mark.parametrize("field", FLOATS, ids=ids(FLOATS))
def test_nan_and_inf_on_the_wire_are_refused(field):
    for token in ("NaN", "Infinity", "-Infinity"):
        body = ChatCompletionRequest.model_validate_json(
            f'{{"messages": [], "{field.name}": {token}}}'
        )
        with pytest.raises(SamplingParamError) as info:
            to_sampling_params(body).validate()
        assert info.value.param == field.name


# ---- bounds, generated from the table ----


def edge_cases() -> list[tuple[SamplingField, str, object, bool]]:
    """(field, what, value, accepted) at each bound of each number field, and wrong types."""
    cases = []
    for field in NUMBERS:
        for bound, outward in ((field.low, -math.inf), (field.high, math.inf)):
            if bound is None:
                continue
            value = field.type(bound.value)
            step = 1 if outward > 0 else -1
            outside = value + step if field.type is int else math.nextafter(value, outward)
            inside = value - step if field.type is int else math.nextafter(value, -outward)
            side = "low" if outward < 0 else "high"
            cases.append((field, f"{side}={value}", value, bound.closed))
            cases.append((field, f"{side}-outside={outside}", outside, outside == field.off))
            cases.append((field, f"{side}-inside={inside}", inside, True))
        if field.off is not None:
            cases.append((field, "off", field.off, True))
        if field.type is int:
            cases.append((field, "int64-max", INT64[1], field.high is None))
            cases.append((field, "int64-overflow", INT64[1] + 1, False))
            cases.append((field, "int64-min", INT64[0], field.low is None))
            cases.append((field, "int64-underflow", INT64[0] - 1, False))
            cases.append((field, "float", 2.0, False))
        else:
            cases += [(field, str(v), v, False) for v in (math.nan, math.inf, -math.inf)]
        cases.append((field, "bool", True, False))
        cases.append((field, "string", "1", False))
    # A list field's items are checked as its type: the same cases, each in a list.
    cases = [(f, w, [v] if f.shape == "list" else v, ok) for f, w, v, ok in cases]
    return [(f, "neutral", f.neutral, True) for f in FIELDS if f.neutral is not None] + cases


EDGES = edge_cases()


@pytest.mark.parametrize(
    ("field", "value", "accepted"),
    [(f, v, ok) for f, _, v, ok in EDGES],
    ids=[f"{f.name}:{what}" for f, what, _, _ in EDGES],
)
def test_bounds_are_enforced_at_both_edges(field, value, accepted):
    if accepted:
        SamplingParams(**{field.name: value}).validate()
        field.check(value)
    else:
        assert_refused(field, value)


def test_every_number_field_has_an_edge_case_or_is_unbounded_int():
    covered = {f.name for f, what, _, _ in EDGES if "outside" in what}
    for field in NUMBERS:
        assert field.name in covered or (field.type is int and field.low is field.high is None)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("temperature", 2.5, "temperature: must be in [0, 2] (0 = greedy), got 2.5"),
        ("top_p", 0.0, "top_p: must be in (0, 1], got 0.0"),
        ("top_k", 0, "top_k: must be -1 (off) or >= 1, got 0"),
        ("min_p", 1.5, "min_p: must be in [0, 1], got 1.5"),
        ("repetition_penalty", 0, "repetition_penalty: must be in (0, 10] (1 = off), got 0"),
        ("presence_penalty", -3, "presence_penalty: must be in [-2, 2], got -3"),
        ("n", 0, "n: must be >= 1, got 0"),
        ("max_tokens", 1.5, "max_tokens: must be an integer, got 1.5"),
        ("temperature", "hot", "temperature: must be a number, got 'hot'"),
        ("seed", 2**64, "seed: must fit a signed 64-bit integer, got 18446744073709551616"),
        ("stop", [""], "stop: must be a non-empty string or list of them, got ''"),
        ("stop_token_ids", ["x"], "stop_token_ids: must be an integer, got 'x'"),
        ("ignore_eos", "yes", "ignore_eos: must be a boolean, got 'yes'"),
    ],
)
def test_messages_name_the_field_and_the_range(name, value, message):
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(**{name: value}).validate()
    assert str(info.value) == message


@pytest.mark.parametrize("value", ["stop", ["a", "b"], ("a",)])
def test_stop_accepts_a_string_or_a_list(value):
    SamplingParams(stop=value).validate()


@pytest.mark.parametrize("value", [5, [5], [True], "", {"a": 1}])
def test_stop_refuses_other_shapes(value):
    assert_refused(FIELD["stop"], value)


BOOLS = [f for f in FIELDS if f.type is bool]


@pytest.mark.parametrize("field", BOOLS, ids=ids(BOOLS))
def test_bool_fields_take_only_booleans(field):
    for value in (True, False):
        field.check(value)
    for value in (1, 0, "yes", None):
        with pytest.raises(SamplingParamError):
            field.check(value)
    assert_refused(field, 1)


def test_stop_token_ids_items_are_int64():
    SamplingParams(stop_token_ids=[0, 5]).validate()
    for bad in ([True], [2**63], [1.0], 3):
        assert_refused(FIELD["stop_token_ids"], bad)


# ---- --sampling-defaults parses by the table's type ----


LAYERED = [f for f in FIELDS if f.layered]


@pytest.mark.parametrize("field", LAYERED, ids=ids(LAYERED))
def test_spec_parses_each_layered_field_with_its_type(field):
    parsed = parse_sampling_spec(f"{field.name}={field.neutral}")
    assert parsed == {field.name: field.neutral}
    assert type(parsed[field.name]) is field.type
    if field.type is int:
        with pytest.raises(SpecError, match=f"{field.name} must be an integer"):
            parse_sampling_spec(f"{field.name}=0.5")
    for text in ("nan", "inf"):
        with pytest.raises(SpecError, match=field.name):
            parse_sampling_spec(f"{field.name}={text}")


def test_spec_takes_an_operator_max_tokens_of_at_least_one():
    assert parse_sampling_spec("max_tokens=4096,temperature=0.6") == {
        "max_tokens": 4096,
        "temperature": 0.6,
    }
    with pytest.raises(SpecError, match="max_tokens: an operator default must be >= 1"):
        parse_sampling_spec("max_tokens=0")
    with pytest.raises(SpecError, match="max_tokens must be an integer"):
        parse_sampling_spec("max_tokens=1.5")
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingDefaults(operator={"max_tokens": -3})


def test_spec_refuses_per_request_fields():
    with pytest.raises(SpecError, match="unknown sampling field 'seed'"):
        parse_sampling_spec("seed=1")
