"""Speculative decoding by prompt lookup (issue 22). With it on, a greedy request's output and
logprobs are the same bits as with it off, in every setting the engine has; a seeded request's
output is the same tokens; unseeded sampled output has the same distribution (a chi-square test
per sampling setting, proposals forced to hit and to miss); what it did is reported."""

from __future__ import annotations

import dataclasses
from collections import Counter

import httpx
import pytest
import torch
from scipy.stats import chi2_contingency

import thermostat.engine.scheduler as scheduler_module
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
from thermostat.sampling.structured import StructuredOutput

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
    with pytest.raises(ValueError, match="k, ngram and max_running"):
        SpeculativeConfig("ngram", k=0)
    with pytest.raises(ValueError, match="k, ngram and max_running"):
        EngineConfig(speculative="ngram", speculative_max_running=0)


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
    """The case's greedy loops are what prompt lookup proposes well: most proposals hold. A
    seeded sampled request in the same batch speculates too, and its output is the same tokens
    (each emitted token takes the draws it takes without speculation)."""
    prompts = ["The king", "My lord,"]
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=64, logprobs=1)]
    _, off = generate("demo", prompts, params)
    llm, on = generate("demo", prompts, params, speculative="ngram")
    same(off, on)
    stats = [o.sampling.get("speculative") for o in on]
    assert stats[0]["method"] == "ngram" and stats[0]["k"] == 4
    assert stats[0]["proposed"] >= stats[0]["accepted"] > 0  # the loop is looked up
    # k proposals at most per step; the steps that checked them saved `accepted` decode steps
    assert stats[0]["steps"] * 4 >= stats[0]["proposed"] > stats[0]["steps"] > 0
    assert stats[1]["proposed"] > stats[1]["accepted"] > 0  # sampled: some held, some did not
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


# MLA's absorbed decode, V3's router and dense first layer, the MoE families, Qwen2's biases,
# Mistral's sliding window config
@pytest.mark.parametrize(
    "kind", ["deepseek_v2", "deepseek_v3", "qwen3_moe", "mixtral", "qwen2", "mistral", "qwen3"]
)
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
        steps = f"thermostat_speculative_verification_steps_total {float(spec['steps'])}"
        assert steps in metrics


# --- sampled output keeps its distribution ------------------------------------------------------

PROMPT = "My lord, my lord, my lord, my"  # a prefix whose next tokens are few enough to count
SAMPLES = 1000  # per run: sequences of 3 tokens
ALPHA = 1e-3  # a chi-square test's p-value below this fails (each run is seeded: deterministic)
SETTINGS = {
    "temperature": SamplingParams(temperature=0.7),
    "top_p": SamplingParams(temperature=1.0, top_p=0.6),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "min_p": SamplingParams(temperature=1.0, min_p=0.05),
    "penalties": SamplingParams(temperature=0.6, repetition_penalty=1.2, frequency_penalty=0.5),
    "grammar": SamplingParams(  # a mask that differs between the positions
        temperature=1.0,
        structured=StructuredOutput.regex("( my| lord)(,| good)( sweet| noble| my)", "regex"),
    ),
}


def chain(llm: LLM, rank: int, params: SamplingParams) -> list[int]:
    """Proposals: at each of 3 positions along the greedy continuation of PROMPT (under the
    setting's grammar), the token of `rank` there (1: the most likely)."""
    probe = SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2, structured=params.structured
    )
    out = llm.generate([PROMPT], probe)[0]
    return [lp.top[rank - 1][0] for lp in out.completions[0].logprobs]


@pytest.fixture(scope="module")
def engines() -> tuple[LLM, LLM]:
    """The demo without and with speculation, room for every sample's request at once (and every
    one speculating)."""
    options = {"max_num_seqs": 256, "speculative_max_running": 256}
    return LLM("demo", **options), LLM("demo", speculative="ngram", speculative_k=2, **options)


def sample_sequences(
    llm: LLM, params: SamplingParams, monkeypatch, proposals: list[int] | None = None
) -> tuple[Counter, int, int]:
    """SAMPLES unseeded 3-token continuations of PROMPT (the default generator seeded first), and
    the proposed and accepted tokens. `proposals`: what each step proposes (the rest of this list
    from the request's position) instead of prompt lookup."""
    prompt = llm.tokenizer.encode(PROMPT)
    if proposals is not None:

        def forced(tokens: list[int], ngram: int, k: int) -> list[int]:
            at = len(tokens) - len(prompt)
            return proposals[at : at + k]

        monkeypatch.setattr(scheduler_module, "propose", forced)
    params = dataclasses.replace(params, max_tokens=3, ignore_eos=True)
    torch.manual_seed(1234)
    outs = llm.generate([prompt] * SAMPLES, params)
    spec = [o.sampling.get("speculative", {}) for o in outs]
    counts = Counter(tuple(o.token_ids) for o in outs)
    return counts, sum(s.get("proposed", 0) for s in spec), sum(s.get("accepted", 0) for s in spec)


def homogeneity(a: Counter, b: Counter) -> float:
    """The p-value of a chi-square test that two samples come from one distribution over
    sequences; sequences seen fewer than 10 times in both together are pooled into one cell."""
    seen = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
    cells = [c for c in seen if a[c] + b[c] >= 10]
    rest = [c for c in seen if a[c] + b[c] < 10]
    table = [[x[c] for c in cells] + [sum(x[c] for c in rest)] for x in (a, b)]
    if not rest:
        table = [row[:-1] for row in table]
    assert len(table[0]) >= 2, "the test needs at least two cells"
    return float(chi2_contingency(table).pvalue)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampled_distribution_is_unchanged(setting, engines, monkeypatch) -> None:
    """For each sampling setting: 1000 sequences of 3 tokens without speculation, and with
    proposals forced to hit (the most likely chain) and to miss (the second most likely; the
    first token is sampled at the prefill, the second and third in one step that checks a
    proposal); the joint distribution of the 3 tokens is the same (chi-square test of
    homogeneity, p >= 1e-3), and both runs with speculation accepted some proposals and
    rejected others."""
    params = SETTINGS[setting]
    plain, speculating = engines
    off, _, _ = sample_sequences(plain, params, monkeypatch)
    for rank in (1, 2):
        proposals = chain(plain, rank, params)
        on, proposed, held = sample_sequences(speculating, params, monkeypatch, proposals)
        p_value = homogeneity(off, on)
        assert p_value >= ALPHA, f"{setting}, proposals of rank {rank}: p = {p_value:.2e}"
        assert proposed > held > 0


def test_the_chi_square_test_sees_a_small_change(engines, monkeypatch) -> None:
    """The test above has power at its sample size: temperature 0.8 against 0.9 is refused."""
    plain, _ = engines
    a, _, _ = sample_sequences(plain, SETTINGS["temperature"], monkeypatch)
    b, _, _ = sample_sequences(plain, SamplingParams(temperature=0.9), monkeypatch)
    assert homogeneity(a, b) < ALPHA


def test_seeded_output_is_the_same_alone_batched_and_without_speculation() -> None:
    """A seeded request takes the same draws per emitted token with speculation on or off, and
    whether it speculates (alone) or not (above max_running): the same output every time."""
    seeded = [
        SamplingParams(temperature=t, seed=s, max_tokens=48, ignore_eos=True, **extra)
        for t, s, extra in [
            (0.7, 1, {}),
            (1.0, 2, {"top_p": 0.9, "repetition_penalty": 1.2}),
            (0.9, 3, {"top_k": 20, "frequency_penalty": 0.3}),
            (1.0, 4, {"structured": StructuredOutput.regex("[A-Z][a-z]+(, [a-z]+)*", "regex")}),
            (0.8, 5, {"dry_multiplier": 0.8, "xtc_probability": 0.5, "xtc_threshold": 0.05}),
        ]
    ]
    prompts = ["The king", "My lord,", "Enter HAMLET", "HAMLET. Words, words, words, words", "My"]
    plain = LLM("demo").generate(prompts, seeded)
    speculating = LLM("demo", speculative="ngram")
    alone = [speculating.generate([p], s)[0] for p, s in zip(prompts, seeded, strict=True)]
    crowded = speculating.generate(prompts * 2, seeded * 2)[:5]  # 10 running > max_running
    for want, one, many in zip(plain, alone, crowded, strict=True):
        assert want.token_ids == one.token_ids == many.token_ids
    assert sum(o.sampling["speculative"]["accepted"] for o in alone) > 0
    assert all(o.sampling["speculative"]["proposed"] == 0 for o in crowded)


def test_greedy_with_dry_equals_no_speculation_and_breaks_the_loop() -> None:
    """DRY penalises the token that would extend a repeat, counting a speculating row's
    proposals before it as output: the same bits with speculation on or off, and the demo's
    greedy loop is not the output any more."""
    prompts = ["My lord, my lord, my lord,", "The king"]
    dry = dataclasses.replace(GREEDY, max_tokens=48, dry_multiplier=0.8)
    _, looping = generate("demo", prompts, dataclasses.replace(GREEDY, max_tokens=48))
    _, off = generate("demo", prompts, dry)
    _, on = generate("demo", prompts, dry, speculative="ngram")
    same(off, on)
    assert all(a.token_ids != b.token_ids for a, b in zip(looping, off, strict=True))
    assert off[0].sampling["effective"]["dry_multiplier"] == 0.8


def test_constrained_greedy_equals_no_speculation() -> None:
    """Proposals go only as far as the grammar takes them; the accepted ones advance it."""
    schema = {
        "type": "object",
        "properties": {"lines": {"type": "array", "items": {"type": "string"}}},
        "required": ["lines"],
    }
    params = SamplingParams(
        temperature=0.0,
        max_tokens=80,
        logprobs=1,
        structured=StructuredOutput.json_schema(schema, "guided_json"),
    )
    prompt = 'KING. {"lines": ["my lord", "my lord", "my lord'
    _, off = generate("demo", [prompt], params)
    _, on = generate("demo", [prompt], params, speculative="ngram")
    same(off, on)
    assert on[0].sampling["speculative"]["accepted"] > 0


def test_seeded_output_is_the_same_with_proposals_forced_to_hold_and_fail(monkeypatch) -> None:
    """Each step proposes the next 4 tokens of the output without speculation, every third one
    replaced by another: the proposals before a replaced one hold only if every row's
    distribution is the one its position has without speculation (penalties counting the
    proposals before it, the grammar advanced past them), and the replaced one is refused."""
    grammar = StructuredOutput.regex("[A-Z][a-z]+(, [a-z]+)*", "regex")
    seeded = [
        SamplingParams(temperature=0.7, seed=5, frequency_penalty=0.4, repetition_penalty=1.1),
        SamplingParams(temperature=0.8, seed=6, presence_penalty=1.5, top_k=40),
        SamplingParams(temperature=1.0, seed=7, top_p=0.9, min_p=0.02),
        SamplingParams(temperature=1.0, seed=8, structured=grammar),
        SamplingParams(temperature=0.8, seed=9, dry_multiplier=1.0, xtc_probability=0.5),
    ]
    seeded = [dataclasses.replace(p, max_tokens=40, ignore_eos=True) for p in seeded]
    llm = LLM("demo", speculative="ngram")
    texts = ("My lord, my lord, my lord, my", "The king", "Enter", "KING. Go", "O Romeo, Romeo")
    prompts = [llm.tokenizer.encode(p) for p in texts]
    plain = LLM("demo").generate(prompts, seeded)
    wanted = {tuple(p): o.token_ids for p, o in zip(prompts, plain, strict=True)}

    def forced(tokens: list[int], ngram: int, k: int) -> list[int]:
        prompt = next(p for p in wanted if tuple(tokens[: len(p)]) == p)
        at = len(tokens) - len(prompt)
        ahead = wanted[prompt][at : at + k]
        return [t if (at + i) % 3 else (t + 1) % 1000 for i, t in enumerate(ahead)]

    monkeypatch.setattr(scheduler_module, "propose", forced)
    for prompt, params, want in zip(prompts, seeded, plain, strict=True):
        out = llm.generate([prompt], params)[0]
        assert out.token_ids == want.token_ids
        spec = out.sampling["speculative"]
        assert spec["proposed"] > spec["accepted"] > 0
