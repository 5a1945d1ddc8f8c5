"""Prefill/decode handoff inside the engine: one engine computes prompts and samples their first
token (`add_group(handoff=True)`), another continues from there (`add_group(handoffs=...)`).
The continuation must equal what one engine alone generates, token for token: greedy and seeded,
bf16 and fp8 KV, block sizes that differ, n > 1, prompt logprobs."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import write_model
from thermostat import LLM, SamplingParams
from thermostat.engine.llm_engine import LLMEngine
from thermostat.engine.outputs import Completion
from thermostat.engine.steps import Handoff

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11], list(range(40, 90)), [200, 201, 202, 203] * 9]
MAX_STEPS = 10_000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("handoff"), "llama", dtype=torch.bfloat16)


def add(engine: LLMEngine, group_id: str, prompts, params, **options):
    return engine.add_group(group_id, engine.plan(prompts, params), **options)


def run(
    engine: LLMEngine, prompts, params, **options
) -> dict[int, tuple[Completion, Handoff | None]]:
    """Add one group, step until it is done; per index its completion and what it handed off."""
    queued = add(engine, "g", prompts, params, **options)
    index = {q.req_id: q.index for q in queued}
    done: dict[int, tuple[Completion, Handoff | None]] = {
        q.index: (Completion(), None) for q in queued
    }
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        for delta in engine.step():
            completion, _ = done[index[delta.req_id]]
            completion.add(delta)
            if delta.handoff is not None:
                done[index[delta.req_id]] = (completion, delta.handoff)
    assert not engine.has_unfinished()
    return done


def engine(model_dir, **config) -> LLMEngine:
    return LLM(str(model_dir), **config).engine


GREEDY_12 = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize(  # greedy with both caches; the other cases alternate (suite time)
    "params,kv_cache_dtype",
    [
        (GREEDY_12, "auto"),
        (GREEDY_12, "fp8_e4m3"),
        (
            SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=3, max_tokens=12, ignore_eos=True),
            "fp8_e4m3",
        ),
        (SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2, logprobs=1), "auto"),
        (SamplingParams(temperature=0.0, max_tokens=1), "fp8_e4m3"),
    ],
    ids=["greedy-auto", "greedy-fp8", "seeded-n3-fp8", "logprobs-auto", "one-token-fp8"],
)
def test_handoff_continues_as_one_engine_would(model_dir, kv_cache_dtype, params):
    single = engine(model_dir, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    prefill = engine(model_dir, kv_cache_dtype=kv_cache_dtype, block_size=16)
    decode = engine(model_dir, kv_cache_dtype=kv_cache_dtype, block_size=4)
    for prompt in PROMPTS:
        expected = run(single, prompts=[prompt], params=params)
        handed = run(prefill, prompts=[prompt], params=params, handoff=True)
        for i, (c, p) in handed.items():  # the prefill's first token is the single engine's
            assert c.finish_reason == "handoff" and c.token_ids == expected[i][0].token_ids[:1]
            assert p is not None and p.rows.num_tokens == len(prompt)
            assert p.first_token == c.token_ids[0]
        handoffs = [handed[i][1] for i in sorted(handed)]
        got = run(decode, prompts=[prompt], params=params, handoffs=handoffs)
        for i, (completion, _) in expected.items():
            assert got[i][0].token_ids == completion.token_ids
            assert got[i][0].text == completion.text
            if params.logprobs is not None:
                assert got[i][0].logprobs == completion.logprobs
        assert prefill.blocks.num_free_blocks == prefill.blocks.num_blocks
        assert decode.blocks.num_free_blocks == decode.blocks.num_blocks


def first_prompt_logprobs(engine: LLMEngine, prompts, params, **options):
    """The prompt logprobs of the one request of a group (its first delta carries them)."""
    add(engine, "p", prompts, params, **options)
    for _ in range(MAX_STEPS):
        for delta in engine.step():
            if delta.prompt_logprobs is not None:
                while engine.has_unfinished():
                    engine.step()
                return delta.prompt_logprobs
    raise AssertionError("no prompt logprobs")


def test_prompt_logprobs_travel_with_the_rows(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    prompt = PROMPTS[0]
    expected = first_prompt_logprobs(engine(model_dir), prompts=[prompt], params=params)
    handed = run(engine(model_dir), prompts=[prompt], params=params, handoff=True)
    prefilled = handed[0][1]
    assert prefilled is not None and prefilled.prompt_logprobs == expected
    assert prefilled.first_logprobs is None  # not asked for
    seen = first_prompt_logprobs(
        engine(model_dir), prompts=[prompt], params=params, handoffs=[prefilled]
    )
    assert seen == expected


def test_rows_that_do_not_fit_are_refused_and_nothing_stays(model_dir):
    prefill, decode = engine(model_dir), engine(model_dir, kv_cache_dtype="fp8_e4m3")
    params = SamplingParams(temperature=0.0, max_tokens=3)
    handed = run(prefill, prompts=[PROMPTS[0]], params=params, handoff=True)
    with pytest.raises(ValueError, match="do not fit"):  # bf16 rows into an fp8 cache
        add(decode, "d", [PROMPTS[0]], params, handoffs=[handed[0][1]])
    with pytest.raises(ValueError, match="do not fit"):  # rows of another prompt length
        add(prefill, "d", [PROMPTS[0] + [1]], params, handoffs=[handed[0][1]])
    assert not decode.has_unfinished() and not prefill.has_unfinished()


def test_fp8_rows_are_copied_bit_exactly(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=1)
    prefill = engine(model_dir, kv_cache_dtype="fp8_e4m3", block_size=16)
    handed = run(prefill, prompts=[PROMPTS[2]], params=params, handoff=True)[0][1]
    assert handed is not None
    rows = handed
    assert rows.rows.tensors["key"].dtype == torch.uint8 and "key.scale" in rows.rows.tensors
    decode = engine(model_dir, kv_cache_dtype="fp8_e4m3", block_size=4)
    slots = torch.arange(rows.rows.num_tokens, dtype=torch.int64) + 8
    decode.cache.load(slots, rows.rows)
    back = decode.cache.export(slots)
    for name, tensor in rows.rows.tensors.items():
        assert torch.equal(back.tensors[name], tensor), name
