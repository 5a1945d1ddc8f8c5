"""Statistical and exact tests for thermostat.engine.sampler.

Expected distributions are computed here from the definitions (plain Python floats, float64)
without calling the code under test. Each distribution test draws N one-token samples from a
[N, V] batch of identical rows and checks, on the tokens the reference keeps:
  * no token outside the kept set ever appears (exact count 0);
  * chi-square goodness of fit, p > P_MIN (bins with expected count < 5 are pooled);
  * total variation distance < TV_BOUND. For a multinomial sample E[TV] <= 0.5 * sqrt(2V/(pi N))
    ~= 0.0098 at V = 12, N = 20000, so 0.03 is ~3x the expected value; each case also checks that
    its parameters move the distribution by more than 2 * TV_BOUND, so a no-op would fail.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from thermostat.engine import sampler
from thermostat.engine.logprobs import top_alternatives
from thermostat.engine.repetition import apply_penalties, token_counts
from thermostat.engine.sampler import (
    SamplingBatch,
    apply_top_k_top_p_min_p,
    sample_batch,
    sample_from_probs,
)
from thermostat.sampling.fields import BUILTIN

V = 12
DRY_XTC = [n for n in BUILTIN if n.startswith(("dry_", "xtc_"))]
N = 20_000
TV_BOUND = 0.03
P_MIN = 1e-4


@pytest.fixture(autouse=True)
def _seed_default_generator() -> None:
    torch.manual_seed(1234)


def fixed_logits(seed: int = 0, vocab: int = V, scale: float = 1.5) -> np.ndarray:
    """Deterministic float32 logits (distinct values, no ties)."""
    return (np.random.default_rng(seed).standard_normal(vocab) * scale).astype(np.float32)


def make_batch(
    rows: int,
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    prompt_ids: tuple[int, ...] = (),
    output_ids: tuple[int, ...] = (),
    banned_ids: tuple[int, ...] = (),
    num_logprobs: int | None = None,
    **repetition: float,
) -> SamplingBatch:
    """A batch of ``rows`` identical rows that use the default generator; `repetition`: DRY and
    XTC fields (default: their builtin values, off)."""
    against_loops = {name: [BUILTIN[name]] * rows for name in DRY_XTC}
    against_loops |= {name: [value] * rows for name, value in repetition.items()}
    return SamplingBatch(
        temperature=[temperature] * rows,
        top_k=[top_k] * rows,
        top_p=[top_p] * rows,
        min_p=[min_p] * rows,
        repetition_penalty=[repetition_penalty] * rows,
        frequency_penalty=[frequency_penalty] * rows,
        presence_penalty=[presence_penalty] * rows,
        **against_loops,
        generators=[None] * rows,
        prompt_ids=[list(prompt_ids)] * rows,
        output_ids=[list(output_ids)] * rows,
        banned_ids=[list(banned_ids)] * rows,
        num_logprobs=[num_logprobs] * rows,
    )


def reference_logits(
    logits: np.ndarray,
    *,
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    prompt_ids: tuple[int, ...] = (),
    output_ids: tuple[int, ...] = (),
    banned_ids: tuple[int, ...] = (),
    **_: object,
) -> list[float]:
    """Banned -> -inf, then HF repetition penalty and OpenAI frequency/presence penalties."""
    x = [float(v) for v in logits]
    for t in banned_ids:
        x[t] = -math.inf
    for t in set(prompt_ids) | set(output_ids):
        x[t] = x[t] / repetition_penalty if x[t] > 0 else x[t] * repetition_penalty
    for t, count in Counter(output_ids).items():
        x[t] -= frequency_penalty * count + presence_penalty
    return x


def reference_probs(
    logits: np.ndarray,
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
    **penalties: object,
) -> np.ndarray:
    """The exact sampling distribution, written out from the definitions."""
    x = reference_logits(logits, **penalties)
    if temperature > 0:
        x = [v / temperature for v in x]
    top = max(x)
    weights = [math.exp(v - top) for v in x]
    probs = [w / sum(weights) for w in weights]
    order = sorted(range(len(x)), key=lambda t: (-x[t], t))
    kept = order[:top_k] if 0 < top_k < len(x) else order
    if top_p < 1.0:
        mass = sum(probs[t] for t in kept)
        prefix, acc = [], 0.0
        for t in kept:
            prefix.append(t)
            acc += probs[t] / mass
            if acc >= top_p:
                break
        kept = prefix
    if min_p > 0.0:
        kept = [t for t in kept if probs[t] >= min_p * probs[order[0]]]
    out = np.zeros(len(x))
    for t in kept:
        out[t] = probs[t]
    return out / out.sum()


def chi_square_p(counts: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square p-value over the tokens with expected > 0, pooling bins expected < 5."""
    kept = expected > 0
    obs = counts[kept].astype(np.float64)
    exp = expected[kept] / expected[kept].sum() * counts.sum()  # sums agree to rounding
    small = exp < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    if len(obs) < 2:
        return 1.0
    return float(chisquare(obs, exp).pvalue)


def assert_matches(counts: np.ndarray, expected: np.ndarray) -> None:
    n = counts.sum()
    assert counts[expected == 0].sum() == 0, f"token outside the kept set: {counts}"
    tv = 0.5 * np.abs(counts / n - expected).sum()
    assert tv < TV_BOUND, f"TV {tv:.4f} >= {TV_BOUND}"
    p = chi_square_p(counts, expected)
    assert p > P_MIN, f"chi-square p = {p:.2e}; counts {counts}, expected {expected * n}"


def draw_counts(logits_row: np.ndarray, n: int = N, **params: object) -> np.ndarray:
    logits = torch.from_numpy(logits_row).repeat(n, 1)
    out = sample_batch(logits, make_batch(n, **params))
    return np.bincount(np.asarray(out.token_ids), minlength=len(logits_row))


DISTRIBUTION_CASES = {
    "temperature_0.5": dict(temperature=0.5),
    "temperature_1.5": dict(temperature=1.5),
    "top_k_4": dict(top_k=4),
    "top_p_0.6": dict(top_p=0.6),
    "min_p_0.15": dict(min_p=0.15),
    "top_k_top_p_min_p": dict(temperature=0.8, top_k=7, top_p=0.8, min_p=0.05),
    "repetition_1.8": dict(repetition_penalty=1.8, prompt_ids=(0, 1, 2, 3), output_ids=(6, 9, 9)),
    "frequency_presence": dict(
        frequency_penalty=0.6,
        presence_penalty=0.5,
        prompt_ids=(5, 6, 7),  # prompt tokens must not count for frequency/presence
        output_ids=(6, 6, 6, 7, 9, 9),
    ),
    "banned": dict(banned_ids=(6, 9)),
    "everything": dict(
        temperature=1.3,
        top_k=8,
        top_p=0.9,
        min_p=0.02,
        repetition_penalty=1.3,
        frequency_penalty=0.3,
        presence_penalty=0.4,
        prompt_ids=(0, 2),
        output_ids=(1, 1, 4, 9),
        banned_ids=(3,),
    ),
}


@pytest.mark.parametrize("params", DISTRIBUTION_CASES.values(), ids=DISTRIBUTION_CASES.keys())
def test_sampling_distribution(params: dict) -> None:
    logits = fixed_logits()
    expected = reference_probs(logits, **params)
    plain = reference_probs(logits)
    assert np.abs(expected - plain).sum() > 4 * TV_BOUND  # the parameters have a visible effect
    assert_matches(draw_counts(logits, **params), expected)


def test_prompt_ids_do_not_count_for_frequency_or_presence() -> None:
    logits = fixed_logits(1)
    params = dict(frequency_penalty=2.0, presence_penalty=2.0, prompt_ids=(0, 1, 2, 3, 4))
    assert_matches(draw_counts(logits, **params), reference_probs(logits))


def test_sample_from_probs_exact_and_zero_safe() -> None:
    weights = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0, 1e-3, 0.0])  # unnormalised is fine
    counts = np.bincount(sample_from_probs(weights.repeat(N, 1), [None] * N), minlength=8)
    expected = (weights / weights.sum()).double().numpy()
    assert_matches(counts, expected)
    # A lone denormal weight: p / E underflows to 0 for large E, zero tokens must still lose.
    tiny = torch.zeros(N, 8)
    tiny[:, 5] = 2.0**-149  # smallest float32 subnormal: p / E rounds to 0 whenever E > 2
    assert (sample_from_probs(tiny, [None] * N) == 5).all()


def test_token_counts() -> None:
    ids = [[1, 1, 3], [], [0, 4, 4, 4, 2], []]
    counts = token_counts(ids, 5)
    assert counts.dtype == torch.int32 and counts.shape == (4, 5)
    expected = [[0, 2, 0, 1, 0], [0] * 5, [1, 0, 1, 0, 3], [0] * 5]
    assert counts.tolist() == expected
    assert token_counts([[], []], 5).tolist() == [[0] * 5, [0] * 5]
    assert token_counts([], 5).shape == (0, 5)
    assert token_counts([[4, 4]], 5).tolist() == [[0, 0, 0, 0, 2]]  # last id is not the pad


def test_apply_penalties_per_row() -> None:
    logits = fixed_logits(2)
    rows = [
        dict(repetition_penalty=1.5, prompt_ids=(0, 1), output_ids=(2, 2, 5)),
        dict(frequency_penalty=0.7, presence_penalty=0.2, output_ids=(3, 3, 3, 8)),
        dict(),
    ]
    prompt = [list(r.get("prompt_ids", ())) for r in rows]
    output = [list(r.get("output_ids", ())) for r in rows]
    got = apply_penalties(
        torch.from_numpy(logits).repeat(3, 1),
        token_counts(prompt, V),
        token_counts(output, V),
        torch.tensor([r.get("repetition_penalty", 1.0) for r in rows]),
        torch.tensor([r.get("frequency_penalty", 0.0) for r in rows]),
        torch.tensor([r.get("presence_penalty", 0.0) for r in rows]),
    )
    expected = [reference_logits(logits, **r) for r in rows]
    np.testing.assert_allclose(got.numpy(), np.array(expected), rtol=1e-6, atol=1e-6)


def test_filters_per_row_kept_sets() -> None:
    logits = fixed_logits(3)
    rows = [
        dict(top_k=3),
        dict(top_p=0.5),
        dict(min_p=0.3),
        dict(top_k=6, top_p=0.7, min_p=0.1),
        dict(),
        dict(top_k=V),  # k >= V is off
        dict(top_k=0, top_p=1.0, min_p=0.0),
    ]
    got = apply_top_k_top_p_min_p(
        torch.from_numpy(logits).repeat(len(rows), 1),
        torch.tensor([r.get("top_k", -1) for r in rows]),
        torch.tensor([r.get("top_p", 1.0) for r in rows]),
        torch.tensor([r.get("min_p", 0.0) for r in rows]),
    )
    for row, params in zip(got, rows, strict=True):
        kept = torch.isfinite(row).numpy()
        assert (kept == (reference_probs(logits, **params) > 0)).all(), params
        assert torch.equal(row[kept], torch.from_numpy(logits)[kept])  # survivors unchanged


def test_filters_all_off_returns_input_and_top_k_ties() -> None:
    logits = torch.from_numpy(fixed_logits()).repeat(2, 1)
    off = apply_top_k_top_p_min_p(
        logits, torch.tensor([-1, V]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0])
    )
    assert off is logits
    tied = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0, 2.0]])
    out = apply_top_k_top_p_min_p(tied, torch.tensor([3]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False, False, True]
    # Many ties: exactly k kept, the lower token ids win at the boundary (stable sort).
    values = torch.randint(0, 3, (1, 4096), generator=torch.Generator().manual_seed(3)).float()
    k = 1000
    ranked = sorted(range(4096), key=lambda t: (-values[0, t].item(), t))
    out = apply_top_k_top_p_min_p(
        values, torch.tensor([k]), torch.tensor([1.0]), torch.tensor([0.0])
    )
    assert torch.isfinite(out[0]).nonzero()[:, 0].tolist() == sorted(ranked[:k])


def test_top_k_one_and_temperature_zero_are_argmax() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(5)) * 3
    argmax = logits.argmax(dim=-1).tolist()
    assert sample_batch(logits, make_batch(64, top_k=1, temperature=1.7)).token_ids == argmax
    greedy = make_batch(64, temperature=0.0, top_k=5, top_p=0.3, min_p=0.5, num_logprobs=2)
    assert sample_batch(logits, greedy).token_ids == argmax
    # Greedy uses the penalised logits.
    params = dict(repetition_penalty=3.0, frequency_penalty=1.0, output_ids=tuple(argmax[:5]))
    expected = [int(np.argmax(reference_logits(row.numpy(), **params))) for row in logits]
    assert expected != argmax
    assert sample_batch(logits, make_batch(64, temperature=0.0, **params)).token_ids == expected


def test_mixed_batch_greedy_rows_argmax_and_sampled_rows_sample() -> None:
    row = fixed_logits(4)
    batch = make_batch(N)
    batch.temperature = [0.0 if i % 2 else 1.0 for i in range(N)]
    tokens = np.asarray(sample_batch(torch.from_numpy(row).repeat(N, 1), batch).token_ids)
    assert (tokens[1::2] == int(np.argmax(row))).all()
    sampled = np.bincount(tokens[0::2], minlength=V)
    assert sampled.sum() == N // 2
    assert_matches(sampled, reference_probs(row))


def test_greedy_fast_path_skips_penalties_softmax_and_sort(monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("fast path expected")

    for name in ("apply_penalties", "token_counts", "apply_top_k_top_p_min_p", "sample_from_probs"):
        monkeypatch.setattr(sampler, name, boom)
    monkeypatch.setattr(torch, "softmax", boom)
    monkeypatch.setattr(torch, "sort", boom)
    logits = torch.randn(8, 30)
    out = sample_batch(logits.half(), make_batch(8, temperature=0.0, top_k=3, top_p=0.5))
    assert out.token_ids == logits.half().float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_penalties_skipped_when_neutral(monkeypatch) -> None:
    monkeypatch.setattr(sampler, "token_counts", lambda *a, **k: pytest.fail("penalties computed"))
    batch = make_batch(4, top_p=0.9, prompt_ids=(1, 2), output_ids=(3, 3))
    assert len(sample_batch(torch.randn(4, V), batch).token_ids) == 4


def _seeded_run(
    step_logits: torch.Tensor, position: int, others: list[dict], seed: int, default_seed: int
) -> list[int]:
    """Run several decode steps with the seeded target row at ``position`` among ``others``."""
    torch.manual_seed(default_seed)
    target = dict(temperature=0.9, top_p=0.95, repetition_penalty=1.2, seed=seed)
    rows = others[:position] + [target] + others[position:]
    generators = [torch.Generator().manual_seed(r["seed"]) if "seed" in r else None for r in rows]
    outputs: list[list[int]] = [[] for _ in rows]
    for step in range(step_logits.shape[0]):
        batch = SamplingBatch(
            temperature=[r.get("temperature", 1.0) for r in rows],
            top_k=[r.get("top_k", -1) for r in rows],
            top_p=[r.get("top_p", 1.0) for r in rows],
            min_p=[r.get("min_p", 0.0) for r in rows],
            repetition_penalty=[r.get("repetition_penalty", 1.0) for r in rows],
            frequency_penalty=[r.get("frequency_penalty", 0.0) for r in rows],
            presence_penalty=[0.0 for _ in rows],
            **{name: [BUILTIN[name]] * len(rows) for name in DRY_XTC},
            generators=generators,
            prompt_ids=[[1, 2, 3] for _ in rows],
            output_ids=[list(o) for o in outputs],
            banned_ids=[[0] if i % 2 else [] for i in range(len(rows))],
            num_logprobs=[1 if i == 0 else None for i in range(len(rows))],
        )
        logits = step_logits[step, : len(rows)].clone()
        logits[position] = step_logits[step, -1]  # the target row always sees the same logits
        out = sample_batch(logits, batch)
        for o, t in zip(outputs, out.token_ids, strict=True):
            o.append(t)
    return outputs[position]


def test_seeded_row_is_independent_of_the_batch() -> None:
    steps, vocab = 6, 400
    step_logits = torch.randn(steps, 8, vocab, generator=torch.Generator().manual_seed(9))
    others = [
        dict(seed=77),
        dict(),  # unseeded, default generator
        dict(temperature=0.0),  # greedy
        dict(temperature=0.0, seed=5),  # greedy with a generator: draws nothing
        dict(temperature=1.4, top_k=20, frequency_penalty=0.5),
        dict(seed=78, min_p=0.1),
    ]
    alone = _seeded_run(step_logits, 0, [], seed=42, default_seed=1)
    assert len(alone) == steps
    assert _seeded_run(step_logits, 3, others, seed=42, default_seed=2) == alone
    assert _seeded_run(step_logits, 0, others[1:4], seed=42, default_seed=3) == alone
    assert _seeded_run(step_logits, 6, others, seed=42, default_seed=4) == alone
    assert _seeded_run(step_logits, 3, others, seed=43, default_seed=2) != alone


def test_banned_ids_never_sampled() -> None:
    row = fixed_logits(5)
    top3 = tuple(int(t) for t in np.argsort(-row)[:3])
    counts = draw_counts(row, banned_ids=top3, temperature=2.0)
    assert counts[list(top3)].sum() == 0
    greedy = sample_batch(
        torch.from_numpy(row)[None], make_batch(1, temperature=0.0, banned_ids=top3)
    )
    assert greedy.token_ids == [int(np.argsort(-row)[3])]


def test_logprobs_raw_distribution_after_banning() -> None:
    row = fixed_logits(6)
    n = 400
    banned = (int(np.argmax(row)), 7)
    params = dict(
        temperature=0.6,
        top_k=6,
        repetition_penalty=1.5,
        output_ids=(1, 2),
        banned_ids=banned,
        num_logprobs=3,
    )
    out = sample_batch(torch.from_numpy(row).repeat(n, 1), make_batch(n, **params))
    raw = reference_logits(row, banned_ids=banned)  # no penalties, no temperature
    finite = [v for v in raw if v > -math.inf]
    log_z = max(finite) + math.log(sum(math.exp(v - max(finite)) for v in finite))
    ref = np.array([v - log_z for v in raw])
    best = [int(t) for t in np.argsort(-ref, kind="stable")[:3]]
    assert len(set(out.token_ids)) > 2  # several different chosen tokens are checked
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp is not None and lp.token_id == token
        assert lp.logprob == pytest.approx(ref[token], abs=1e-5)
        assert lp.rank == 1 + int((ref > ref[token]).sum())
        assert [t for t, _ in lp.top] == best
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        np.testing.assert_allclose(values, ref[best], atol=1e-5)


def test_logprobs_per_row_counts() -> None:
    logits = torch.randn(3, V)
    batch = make_batch(3, temperature=0.0)
    batch.num_logprobs = [None, 0, V + 5]
    out = sample_batch(logits, batch)
    assert out.logprobs[0] is None
    assert out.logprobs[1].top == [] and out.logprobs[1].rank == 1
    assert len(out.logprobs[2].top) == V and out.logprobs[2].top[0][0] == out.token_ids[2]


def test_rejects_mismatched_lengths() -> None:
    batch = make_batch(3)
    batch.top_p = [1.0]
    with pytest.raises(ValueError, match="top_p"):
        sample_batch(torch.randn(3, V), batch)


def test_logprob_alternatives_break_ties_by_id_whatever_the_batch() -> None:
    """Equal logprobs (bfloat16 logits tie often) list the lower id first, and a row's k best
    do not depend on the rows beside it (torch.topk's choice among ties does)."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 4, (6, 40), generator=gen).float()  # many ties
    for k in range(41):
        alone = [top_alternatives(rows[i : i + 1], k)[0] for i in range(6)]
        assert top_alternatives(rows, k) == alone
        for i, got in enumerate(alone):
            ranked = sorted(enumerate(rows[i].tolist()), key=lambda p: (-p[1], p[0]))
            assert got == ranked[:k]
