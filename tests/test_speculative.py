"""Speculative decoding by prompt lookup (issue 22, first part: greedy requests). With it on, a
greedy request's output and logprobs are the same bits as with it off, in every setting the
engine has; what it did is reported."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.conftest import write_model
from tests.server_utils import running_server
from thermostat import LLM, SamplingParams
from thermostat.engine.config import EngineConfig
from thermostat.engine.loader import DEMO_MODEL_DIR
from thermostat.engine.speculative import (
    MAX_RUNNING,
    PATIENCE,
    SpeculativeConfig,
    accepted,
    keeps_proposing,
    propose,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
# Prompts whose text repeats (something to look up) and one that does not.
REPEATING = [
    [5, 17, 42, 99, 3, 250, 7, 5, 17, 42, 99, 3],
    [200, 201, 202, 203] * 6,
    [11, 12, 13, 14, 15, 16, 11, 12],
    list(range(40, 90)),
]


# --- the proposer -------------------------------------------------------------------------------


def test_propose_takes_what_followed_the_longest_recent_match() -> None:
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert propose(tokens, ngram=3, k=2) == [7, 8]  # the most recent earlier [1, 2, 3]
    assert propose(tokens, ngram=3, k=9) == [7, 8, 1, 2, 3]
    assert propose([4, 1, 2, 5, 2], ngram=3, k=2) == [5, 2]  # no [1,5,2]/[5,2] before: [2]
    assert propose([1, 2, 3], ngram=3, k=4) == []  # nothing occurred before
    assert propose([7], ngram=3, k=4) == []
    assert propose([3, 3, 3], ngram=2, k=3) == [3]  # [3, 3] ended at 1; what followed: [3]


def test_accepted_is_the_confirmed_prefix() -> None:
    assert accepted([4, 5, 6], [4, 5, 9, 1]) == 2
    assert accepted([4, 5, 6], [1, 5, 6, 1]) == 0
    assert accepted([4, 5, 6], [4, 5, 6, 1]) == 3
    assert accepted([], [8]) == 0


def test_low_acceptance_stops_proposals_and_bad_settings_are_refused() -> None:
    assert keeps_proposing(PATIENCE - 1, 0)
    assert not keeps_proposing(PATIENCE, 0)
    assert keeps_proposing(PATIENCE * 4, PATIENCE)
    with pytest.raises(ValueError, match="speculative must be one of"):
        EngineConfig(speculative="medusa")
    with pytest.raises(ValueError, match="k and ngram"):
        SpeculativeConfig("ngram", k=0)


# --- greedy output is the same bits ---------------------------------------------------------------


def generate(path, prompts, params, **options):
    llm = LLM(str(path), **options)
    outs = llm.generate(prompts, params)
    return llm, outs


def same(a, b, logprobs: bool = True) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        if not logprobs:
            continue
        lx = [(lp.token_id, lp.logprob, lp.top) for lp in x.completions[0].logprobs or []]
        ly = [(lp.token_id, lp.logprob, lp.top) for lp in y.completions[0].logprobs or []]
        assert lx == ly


def test_demo_loops_are_checked_several_tokens_a_step_with_the_same_output() -> None:
    """The case's greedy loops are what prompt lookup proposes well: most proposals hold, and a
    sampled request in the same batch (which does not speculate) is unchanged too."""
    prompts = ["The king", "My lord,"]
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=32)]
    _, off = generate("demo", prompts, params)
    llm, on = generate("demo", prompts, params, speculative="ngram")
    same(off, on)
    stats = [o.sampling.get("speculative") for o in on]
    assert stats[0]["method"] == "ngram" and stats[0]["k"] == 4
    assert stats[0]["proposed"] >= stats[0]["accepted"] > 0  # the loop is looked up
    assert stats[1]["proposed"] == 0  # sampled: not in this version
    assert "speculative" not in off[0].sampling


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"kv_cache_dtype": "fp8_e4m3"},
        {"kv_cache_memory_gb": 26 * 2**-20, "block_size": 4},  # 26 blocks of 4: preemptions
    ],
    ids=["plain", "fp8", "preempted"],
)
def test_llama_greedy_equals_no_speculation(tmp_path, options) -> None:
    path = write_model(tmp_path / "llama", "llama", dtype=torch.bfloat16)
    _, off = generate(path, REPEATING, GREEDY, **options)
    llm, on = generate(path, REPEATING, GREEDY, speculative="ngram", **options)
    # a preempted request's recompute is a prefill (its own arithmetic) at another moment on and
    # off: its tokens are the same, as without speculation (test_engine), not each logprob's bits
    same(off, on, logprobs="block_size" not in options)
    assert sum(o.sampling["speculative"]["proposed"] for o in on) > 0
    if "block_size" in options:
        assert llm.engine.scheduler.num_preemptions > 0


def test_chunked_prefill_beside_speculating_decodes(tmp_path) -> None:
    """A step budget of 8 tokens: a long prompt is prefilled in chunks while the others
    speculate. Each prompt is chunked at the same boundaries on and off (a prompt chunked at
    other boundaries may differ in its last bits, speculation or not: the prefill attention's
    arithmetic depends on the chunk's length)."""
    path = write_model(tmp_path / "llama", "llama", dtype=torch.bfloat16)
    options = {"max_num_batched_tokens": 8, "enable_prefix_caching": False}
    plain, speculating = LLM(str(path), **options), LLM(str(path), speculative="ngram", **options)
    for prompt in REPEATING:
        same(plain.generate([prompt], GREEDY), speculating.generate([prompt], GREEDY))


@pytest.mark.parametrize("kind", ["deepseek_v2", "qwen3_moe"])  # MLA's absorbed decode; MoE
def test_other_families_greedy_equals_no_speculation(tmp_path, kind) -> None:
    path = write_model(tmp_path / kind, kind, dtype=torch.bfloat16)
    _, off = generate(path, REPEATING[:2], GREEDY)
    _, on = generate(path, REPEATING[:2], GREEDY, speculative="ngram")
    same(off, on)


def test_nothing_is_proposed_above_max_running() -> None:
    """Checking k more tokens per sequence is cheap at a few sequences only."""
    prompts = ["The king", "My lord,", "Enter HAMLET", "O, ", "ROMEO.", "Why, then"]
    assert len(prompts) > MAX_RUNNING
    outs = LLM("demo", speculative="ngram").generate(prompts, GREEDY)
    assert all(o.sampling["speculative"]["proposed"] == 0 for o in outs)


def test_prefix_hit_stop_strings_and_max_tokens_apply_per_token() -> None:
    llm = LLM("demo", speculative="ngram")
    plain = LLM("demo")
    prompt = "Enter HAMLET"
    for params in (
        SamplingParams(temperature=0.0, max_tokens=23),  # ends inside an accepted run
        SamplingParams(temperature=0.0, max_tokens=60, stop=["Messenger"]),
    ):
        want = plain.generate([prompt], params)[0]
        first, again = llm.generate([prompt], params)[0], llm.generate([prompt], params)[0]
        assert first.token_ids == again.token_ids == want.token_ids
        assert first.finish_reason == want.finish_reason and first.text == want.text
    assert llm.engine.blocks.main.num_free_blocks == llm.engine.blocks.main.num_blocks


def test_served_responses_say_what_speculation_did() -> None:
    with running_server(DEMO_MODEL_DIR, speculative="ngram") as server:
        body = {"prompt": "The king", "temperature": 0, "max_tokens": 60}
        whole = httpx.post(f"{server.url}/v1/completions", json=body).json()
        spec = whole["sampling"]["speculative"]
        assert spec["method"] == "ngram" and spec["accepted"] > 0
        metrics = httpx.get(f"{server.url}/metrics").text
        assert f"thermostat_speculative_accepted_tokens_total {float(spec['accepted'])}" in metrics
