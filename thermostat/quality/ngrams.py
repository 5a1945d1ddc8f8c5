"""n-gram diversity of the last W tokens: repetition that is not an exact loop at the end.

- distinct-n (Li et al. 2016, "A Diversity-Promoting Objective Function for Neural
  Conversation Models"): unique n-grams / total n-grams. 1.0 = no n-gram repeats.
- seq-rep-n (Welleck et al. 2019, "Neural Text Generation with Unlikelihood Training", §5):
  1 - unique n-grams / total n-grams within a continuation, reported there with n = 4
  (greedy continuations of their maximum-likelihood Wikitext-103 model: about 0.44; human
  text: about 0.006).
- word share: the fraction of the window's tokens that contain a letter. Numbers and
  punctuation (data tables) repeat in healthy text; the repetition of words is what degenerates.

All are taken over the same window (the last W tokens), so long healthy texts are judged by
their recent past and not by how many function words they have accumulated. A window with
fewer than n tokens has no n-grams: distinct-n is 1.0 and seq-rep-n 0.0 (nothing repeats).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from thermostat.quality.tokens import has_letter


def ngram_counts(tokens: Sequence[str], n: int) -> tuple[int, int]:
    """(unique, total) n-grams of `tokens`."""
    total = len(tokens) - n + 1
    if total <= 0:
        return 0, 0
    grams = {tuple(tokens[i : i + n]) for i in range(total)} if n > 1 else set(tokens)
    return len(grams), total


def distinct_n(tokens: Sequence[str], n: int) -> float:
    """unique / total n-grams; 1.0 when there are none."""
    unique, total = ngram_counts(tokens, n)
    return unique / total if total else 1.0


def seq_rep_n(tokens: Sequence[str], n: int) -> float:
    """1 - unique / total n-grams; 0.0 when there are none."""
    return 1.0 - distinct_n(tokens, n)


@dataclass(frozen=True)
class NgramStats:
    """Diversity of one window of tokens."""

    window: int  # tokens in the window (<= W)
    distinct_1: float
    distinct_2: float
    distinct_3: float
    seq_rep_4: float
    word_share: float  # tokens with a letter / tokens; 0.0 for an empty window

    @classmethod
    def of(cls, window: Sequence[str]) -> NgramStats:
        words = sum(has_letter((t,)) for t in window)
        return cls(
            window=len(window),
            distinct_1=distinct_n(window, 1),
            distinct_2=distinct_n(window, 2),
            distinct_3=distinct_n(window, 3),
            seq_rep_4=seq_rep_n(window, 4),
            word_share=words / len(window) if window else 0.0,
        )
