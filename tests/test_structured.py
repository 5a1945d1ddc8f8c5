"""Structured output: the constraint (llguidance), the sampler's mask, the engine's batches of
constrained and free requests, and the server's response_format / guided_* fields through the
official openai client."""

from __future__ import annotations

import json
import random
from typing import Literal

import httpx
import jsonschema_rs
import numpy as np
import pytest
import torch
from pydantic import BaseModel, Field

from tests.conftest import write_model
from tests.schema_gen import random_schemas
from tests.server_utils import running_server
from thermostat import LLM, SamplingParams
from thermostat.engine.constraint import ConstraintCompiler, allowed_ids
from thermostat.engine.sampler import apply_allowed
from thermostat.random_model import build_tokenizer
from thermostat.sampling.structured import ConstraintError, StructuredOutput

VOCAB = 320  # the tiny models' (their tokenizer spells 300 of them)


def valid(schema: dict, text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return jsonschema_rs.validator_for(schema).is_valid(value)


# ---- the constraint alone ----


@pytest.fixture(scope="module")
def compiler() -> ConstraintCompiler:
    return ConstraintCompiler(build_tokenizer(), VOCAB, (0,))


def test_random_walks_through_300_random_schemas_all_validate(compiler):
    """Any token the mask allows keeps the output valid: a uniform random walk over the allowed
    tokens always ends in JSON that validates against its schema."""
    rng = random.Random(0)
    tokenizer = compiler.tokenizer
    for schema in random_schemas(300, seed=1):
        constraint = compiler.compile(StructuredOutput.json_schema(schema, "guided_json"))
        ids: list[int] = []
        while not constraint.complete and len(ids) < 1000:
            token = rng.choice(allowed_ids(constraint.mask(), VOCAB))
            assert constraint.advance(token), constraint.error
            ids.append(token)
        assert constraint.complete
        text = tokenizer.decode([t for t in ids if t != 0])
        assert valid(schema, text), (schema, text)


def test_whitespace_is_bounded_and_raw_control_characters_are_refused(compiler):
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 10}}}
    spec = StructuredOutput.json_schema(schema, "guided_json")

    def accepts(text: str) -> bool:
        constraint = compiler.compile(spec)
        ids = compiler.tokenizer.encode(text, add_special_tokens=False)
        return all(constraint.advance(t) for t in ids)

    assert accepts('{"s":"ab"}') and accepts('{\n  "s": "ab"\n}') and accepts('{"s":"\\u0001"}')
    assert not accepts("{" + " " * 20 + '"s":"ab"}')
    assert not accepts('{"s":"a\x01b"}') and not accepts('{"s":"a\nb"}')
    assert not accepts('{"s":"' + "x" * 11 + '"}')


def test_compiled_grammars_are_cached_and_each_request_gets_its_own_state(compiler):
    spec = StructuredOutput.choice(["yes", "no"], "guided_choice")
    first, second = compiler.compile(spec), compiler.compile(spec)
    assert first.matcher is not second.matcher
    for token in compiler.tokenizer.encode("yes", add_special_tokens=False):
        assert first.advance(token)
    assert first.complete and not second.complete
    assert spec.grammar in compiler._cache


@pytest.mark.parametrize(
    ("build", "param"),
    [
        (lambda: StructuredOutput.json_schema({"type": "strnig"}, "guided_json"), "guided_json"),
        (lambda: StructuredOutput.json_schema({"not": {}}, "response_format"), "response_format"),
        (lambda: StructuredOutput.json_schema("{oops", "guided_json"), "guided_json"),
        (lambda: StructuredOutput.json_schema([1], "guided_json"), "guided_json"),
        (lambda: StructuredOutput.regex("(", "guided_regex"), "guided_regex"),
        (lambda: StructuredOutput.choice([], "guided_choice"), "guided_choice"),
        (lambda: StructuredOutput.lark("start: nope", "guided_grammar"), "guided_grammar"),
    ],
)
def test_bad_schemas_and_grammars_name_their_field(build, param):
    with pytest.raises(ConstraintError) as err:
        build()
    assert err.value.param == param and str(err.value).startswith(param)


def test_the_hash_is_of_the_canonical_schema():
    a = StructuredOutput.json_schema({"type": "object", "required": []}, "guided_json")
    b = StructuredOutput.json_schema('{"required": [], "type": "object"}', "response_format")
    assert a.digest == b.digest and len(a.digest) == 12
    assert b.to_dict() == {"kind": "json_schema", "source": "response_format", "hash": b.digest}


def test_gbnf_grammars_are_read_too():
    assert StructuredOutput.lark('root ::= "a" | "b"', "guided_grammar").kind == "grammar"


# ---- the sampler's mask ----


def test_apply_allowed_masks_only_constrained_rows_and_tokens_past_the_bitmask():
    logits = torch.randn(3, 70)
    mask = np.zeros(2, dtype=np.int32)  # 64 tokens: 0..63; 64..69 are past it
    for t in (0, 5, 31, 33, 63):
        mask[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    out = apply_allowed(logits, [None, mask, None])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    finite = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert finite == [0, 5, 31, 33, 63]
    assert torch.equal(out[1, finite], logits[1, finite])
    assert apply_allowed(logits, [None] * 3) is logits and apply_allowed(logits, []) is logits


# ---- the engine: constrained and free requests in one batch ----


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("qwen3"), "qwen3", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), kv_cache_memory_gb=16 * 2**-10)


def test_engine_batches_constrained_and_free_requests_and_every_output_validates(llm):
    schemas = random_schemas(120, seed=7)
    params = []
    for i, schema in enumerate(schemas):
        spec = StructuredOutput.json_schema(schema, "guided_json")
        params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=600, structured=spec))
        params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=8))  # a free neighbour
    outs = llm.generate(["It was the best of times"] * len(params), params)
    for schema, out in zip(schemas, outs[::2], strict=True):
        assert out.finish_reason == "stop", (schema, out.text)
        assert valid(schema, out.text), (schema, out.text)
        assert out.sampling["constraint"]["kind"] == "json_schema"
    assert all(o.finish_reason == "length" and "constraint" not in o.sampling for o in outs[1::2])


def test_greedy_choice_and_regex(llm):
    choice = StructuredOutput.choice(["alpha", "beta", "gamma"], "guided_choice")
    regex = StructuredOutput.regex(r"[0-9]{3}-[a-z]{2}", "guided_regex")
    outs = llm.generate(
        ["a", "b"],
        [
            SamplingParams(temperature=0.0, structured=choice),
            SamplingParams(temperature=0.0, structured=regex),
        ],
    )
    assert outs[0].text in ("alpha", "beta", "gamma") and outs[0].finish_reason == "stop"
    assert len(outs[1].text) == 6 and outs[1].text[3] == "-" and outs[1].finish_reason == "stop"


def test_a_dead_end_ends_the_request_cleanly(llm):
    """The grammar's only next token is a stop token that min_tokens still bans."""
    tok = llm.tokenizer
    vocab = tok.get_vocab()
    a, b = next((x, y) for x in "abcdefgh" for y in "xyzqjkvw" if x + y not in vocab)
    b_id = tok.convert_tokens_to_ids(b)
    spec = StructuredOutput.regex(a + b, "guided_regex")
    params = SamplingParams(temperature=0.0, stop_token_ids=[b_id], min_tokens=5, structured=spec)
    out = llm.generate(["hello"], params)[0]
    assert (out.text, out.finish_reason, out.completions[0].stop_reason) == (
        a,
        "error",
        "constraint_dead_end",
    )
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free_blocks > 0
    # a constraint that allows no first token at all is refused up front, naming its field
    first = StructuredOutput.regex(b, "guided_regex")
    refused = SamplingParams(stop_token_ids=[b_id], min_tokens=1, structured=first)
    with pytest.raises(ConstraintError) as err:
        llm.generate(["hello"], refused)
    assert err.value.param == "guided_regex"


# ---- the server, through the openai client ----


class Pet(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog", "fish"]
    tags: list[Literal["small", "big"]] = Field(max_length=2)


MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]


@pytest.fixture(scope="module", params=["qwen3", "llama", "demo"])
def server(request, tmp_path_factory, qwen3_dir):
    if request.param == "demo":
        model_dir = "demo"
    elif request.param == "qwen3":
        model_dir = qwen3_dir
    else:
        model_dir = write_model(tmp_path_factory.mktemp("llama"), "llama")
    with running_server(model_dir) as s:
        yield s


def test_parse_with_a_pydantic_model_streaming_and_not(server):
    client = server.client()
    completion = client.chat.completions.parse(
        model=server.model, messages=MESSAGES, response_format=Pet, temperature=0, max_tokens=300
    )
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet) and completion.choices[0].finish_reason == "stop"
    constraint = completion.model_extra["sampling"]["constraint"]
    assert constraint["kind"] == "json_schema" and constraint["source"] == "response_format"
    with client.chat.completions.stream(
        model=server.model, messages=MESSAGES, response_format=Pet, temperature=0, max_tokens=300
    ) as stream:
        streamed = stream.get_final_completion()
    assert streamed.choices[0].message.parsed == pet


def test_json_object_and_guided_fields_on_both_endpoints(server):
    client = server.client()
    out = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
    )
    text, finish = out.choices[0].message.content, out.choices[0].finish_reason
    assert text.startswith("{") and (finish == "length" or isinstance(json.loads(text), dict))
    choice = client.completions.create(
        model=server.model,
        prompt="The answer is",
        max_tokens=10,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert choice.choices[0].text in ("yes", "no")
    regex = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": "[A-Z][a-z]{2,5}"}},
    )
    assert regex.choices[0].message.content.istitle()
    stream = client.completions.create(
        model=server.model,
        prompt="x",
        max_tokens=20,
        stream=True,
        extra_body={"guided_grammar": 'start: "ok" | "not ok"'},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) in ("ok", "not ok")
    assert chunks[-1].model_extra["sampling"]["constraint"]["kind"] == "grammar"


def test_bad_constraints_are_400s_naming_the_field(server):
    url = f"{server.url}/v1/chat/completions"
    base = {"messages": MESSAGES, "max_tokens": 5}
    cases = {
        "response_format": {
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}
        },
        "guided_regex": {"guided_regex": "(["},
        "guided_grammar": {"guided_grammar": "start: undefined_rule"},
        "structured_outputs.json": {"structured_outputs": {"json": {"type": "nope"}}},
        "guided_choice": {"response_format": {"type": "json_object"}, "guided_choice": ["a"]},
    }
    for param, extra in cases.items():
        response = httpx.post(url, json=base | extra, timeout=30)
        assert response.status_code == 400, (param, response.text)
        assert response.json()["error"]["param"] == param, response.text
    missing = {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}
    assert httpx.post(url, json=base | missing, timeout=30).status_code == 400


def test_explain_reports_the_constraint(server):
    body = {"messages": MESSAGES, "guided_json": {"type": "object"}}
    response = httpx.post(f"{server.url}/v1/sampling/explain", json=body, timeout=30)
    expected = StructuredOutput.json_schema({"type": "object"}, "guided_json").to_dict()
    assert response.json()["sampling"]["constraint"] == expected
