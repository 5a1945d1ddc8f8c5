"""What the sampler does against repetition: HF/vLLM's repetition penalty and OpenAI's
frequency and presence penalties (`apply_penalties`), and llama.cpp's samplers against loops,
DRY ("don't repeat yourself", p-e-w's, in llama.cpp's common sampler since b3718) and XTC
("exclude top choices").

DRY penalises the token that would extend a verbatim repeat. For each earlier place in the
context (the last `dry_penalty_last_n` tokens of prompt and output, -1 = all) where the tokens
just before it equal the context's last n tokens, the token that followed there would make the
repeat n + 1 long; with n >= `dry_allowed_length` its logit loses
`dry_multiplier * dry_base ** (n - dry_allowed_length)` (n the longest such repeat of that
token; the exponent capped so the penalty stays finite in float32). A repeat does not extend
across a sequence breaker: a token whose text holds one of `dry_sequence_breakers` (llama.cpp
matches the breaker strings across token boundaries too; here a breaker must sit inside one
token's text, which is where "\\n", ":", '"' and "*" sit in BPE vocabularies). Deterministic in
the context, so a speculating row scored with its proposals as output gets the same penalty as
if they had been sampled one by one.

XTC, with probability `xtc_probability` per sampled token, removes every token at least
`xtc_threshold` probable except the least probable of them (nothing when fewer than two are), on
the distribution the row samples from (after temperature, top-k, top-p and min-p). Its coin is a
uniform drawn from a generator seeded by the request's seed and the token's position, so a
seeded row draws the same coins however its tokens are batched or speculated; an unseeded row
draws from the default generator. Greedy rows are never excluded from (argmax is argmax).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

_FLOAT32_MAX_LOG = math.log(torch.finfo(torch.float32).max)


def token_counts(
    ids: list[list[int]], vocab_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Return [B, V] int32 counts of each token id per row (rows may be empty).

    Rows are right-padded with the sentinel id ``vocab_size`` into a [B, V+1] buffer, counted with
    one ``scatter_add_`` and the sentinel column is dropped, so there is no Python loop over tokens.
    """
    rows = len(ids)
    width = max((len(row) for row in ids), default=0)
    counts = torch.zeros((rows, vocab_size + 1), dtype=torch.int32, device=device)
    if rows and width:
        padded = torch.tensor(
            [list(row) + [vocab_size] * (width - len(row)) for row in ids],
            dtype=torch.int64,
            device=device,
        )
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_counts: torch.Tensor | None,
    output_counts: torch.Tensor,
    repetition_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
) -> torch.Tensor:
    """Return penalised copy of ``logits`` [B, V]; penalty tensors are [B] float32.

    Repetition (HF/vLLM, 1.0 = off): every token seen in the prompt OR the output has a positive
    logit divided by r and a non-positive one multiplied by r. Frequency/presence (OpenAI, 0 = off)
    count OUTPUT tokens only: ``logit -= f * count + p * (count > 0)``. ``prompt_counts`` may be
    None when no prompt tokens should count. Neutral values are exact no-ops (x / 1, x - 0).
    """
    seen = output_counts > 0
    if prompt_counts is not None:
        seen = seen | (prompt_counts > 0)
    r = repetition_penalty[:, None]
    repeated = torch.where(logits > 0, logits / r, logits * r)
    out = torch.where(seen, repeated, logits)
    out = out - frequency_penalty[:, None] * output_counts.to(out.dtype)
    return out - presence_penalty[:, None] * (output_counts > 0).to(out.dtype)


def dry_penalties(
    context: Sequence[int],
    breakers: frozenset[int],
    multiplier: float,
    base: float,
    allowed_length: int,
) -> dict[int, float]:
    """{token id: what DRY subtracts from its logit} for one row's context (already cut to its
    last n tokens). Candidate places are found by extending all repeats of the last token at
    once, one step back per round, so the work is the total length of the repeats found."""
    ctx = np.asarray(context, dtype=np.int64)
    last = len(ctx) - 1
    if last < 1 or multiplier == 0.0:
        return {}
    is_breaker = np.isin(ctx, np.fromiter(breakers, dtype=np.int64, count=len(breakers)))
    ends = np.arange(last)  # a repeat ending at ctx[e] (e < last) is followed by ctx[e + 1]
    length = np.zeros(last, dtype=np.int64)
    for k in range(last):  # compare ctx[e - k] with ctx[last - k]
        if is_breaker[last - k]:
            break
        ends = ends[ends >= k]
        ends = ends[ctx[ends - k] == ctx[last - k]]
        if not len(ends):
            break
        length[ends] = k + 1
    found = length >= allowed_length
    if not found.any():
        return {}
    tokens, lengths = ctx[1:][found], length[found]
    longest: dict[int, int] = {}
    for token, n in zip(tokens.tolist(), lengths.tolist(), strict=True):
        longest[token] = max(longest.get(token, 0), n)
    cap = (_FLOAT32_MAX_LOG - math.log(multiplier)) / math.log(base) - 1
    return {
        token: multiplier * base ** min(n - allowed_length, cap) for token, n in longest.items()
    }


def apply_dry(
    logits: torch.Tensor,
    prompts: Sequence[list[int]],
    outputs: Sequence[list[int]],
    breakers: Sequence[frozenset[int]],
    multiplier: Sequence[float],
    base: Sequence[float],
    allowed_length: Sequence[int],
    last_n: Sequence[int],
) -> torch.Tensor:
    """`logits` [B, V] with each DRY row's penalties subtracted (the input itself if no row has
    DRY on); a row's context is its prompt, then its output."""
    rows = [i for i, m in enumerate(multiplier) if m > 0.0]
    if not rows:
        return logits
    out = logits.clone()
    for i in rows:
        whole = prompts[i] + outputs[i]
        context = whole if last_n[i] < 0 else whole[len(whole) - last_n[i] :]
        penalties = dry_penalties(context, breakers[i], multiplier[i], base[i], allowed_length[i])
        if penalties:
            ids = torch.tensor(list(penalties), dtype=torch.int64)
            values = torch.tensor(list(penalties.values()), dtype=out.dtype)
            out[i, ids] -= values
    return out


def xtc_coins(seeds: Sequence[int | None], positions: Sequence[int]) -> list[float]:
    """One uniform in [0, 1) per row: from a generator seeded by (seed, position) for a seeded
    row, else from the default generator."""
    coins = []
    for seed, position in zip(seeds, positions, strict=True):
        if seed is None:
            coins.append(float(torch.rand((), dtype=torch.float64)))
        else:
            mixed = (seed * 0x9E3779B97F4A7C15 + position) % (1 << 63)
            generator = torch.Generator().manual_seed(mixed)
            coins.append(float(torch.rand((), dtype=torch.float64, generator=generator)))
    return coins


def apply_xtc(
    probs: torch.Tensor, probability: torch.Tensor, threshold: torch.Tensor, coins: torch.Tensor
) -> torch.Tensor:
    """`probs` [B, V] (a row's sampling distribution) with XTC's exclusion where a row's coin
    [B] falls below its probability [B]: the tokens at or above its threshold but the least
    probable of them set to 0 (nothing when fewer than two are); the input itself if no row
    excludes."""
    on = coins < probability
    if not bool(on.any()):
        return probs
    above = probs >= threshold[:, None]
    enough = above.sum(dim=-1) >= 2
    rows = on & enough
    if not bool(rows.any()):
        return probs
    least = torch.where(above, probs, torch.inf).min(dim=-1, keepdim=True).values
    drop = above & (probs > least) & rows[:, None]
    return probs.masked_fill(drop, 0.0)


@dataclass
class BreakerTokens:
    """The token ids whose text holds one of a set of breaker strings, per set (cached); every
    id's text is read once, on first use (`texts`: the tokenizer's, in id order)."""

    texts: Callable[[], list[str]]
    _texts: list[str] | None = None
    _cache: dict[tuple[str, ...], frozenset[int]] = field(default_factory=dict)

    def ids(self, breakers: tuple[str, ...]) -> frozenset[int]:
        if breakers not in self._cache:
            if self._texts is None:
                self._texts = self.texts()
            self._cache[breakers] = frozenset(
                i for i, text in enumerate(self._texts) if any(b in text for b in breakers)
            )
        return self._cache[breakers]
