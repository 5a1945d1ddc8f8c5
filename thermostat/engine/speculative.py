"""Speculative decoding by prompt lookup: propose the tokens that followed the last n tokens the
last time they occurred in the prompt or the output, and have the model check them in the step
that computes the request's next token.

A request that speculates schedules `[last, p1 .. pk]` (its last sampled token and k proposals);
the runner computes every one of them as a decode row of its own (the same attention and the
same per-row arithmetic as a plain decode step at that position, so greedy output is the same
bits with speculation on or off), and takes the model's token at each row: t0 follows `last`,
t1 follows p1, ... The proposals are accepted while they equal the model's tokens; the step emits
t0 .. tm (m proposals confirmed, then the model's own next token) and keeps the K/V of `last` and
p1 .. pm. Rejected proposals leave rows past the request's computed tokens, which the next steps
overwrite.

Requests propose only while at most MAX_RUNNING run. This version speculates for greedy
requests only, without penalties, a grammar or a pending
`min_tokens` (their next-token rule depends on the tokens before it), and not on caches with
window pools (DeepSeek-V4's compressors keep state a rejected token would change).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from thermostat.sampling.params import EffectiveParams

METHODS = ("off", "ngram")
# Proposals only while at most this many requests run: a decode step reads the weights once
# whatever its rows, so at a few sequences checking k more tokens costs little (k = 4: about 1.05x
# a plain step at batch 1), but at 8 sequences it costs 2.7x (benchmarks/bench_speculative.py).
MAX_RUNNING = 4
LOW_ACCEPTANCE = 0.1  # below this share, after PATIENCE proposed tokens, a request stops proposing
PATIENCE = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "off"  # off | ngram
    k: int = 4  # tokens proposed per step at most
    ngram: int = 3  # the longest suffix matched; shorter ones down to 1 are tried in turn

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative must be one of {', '.join(METHODS)}, got {self.method!r}"
            )
        if self.k < 1 or self.ngram < 1:
            raise ValueError(f"speculative k and ngram must be >= 1, got {self.k}, {self.ngram}")

    @property
    def on(self) -> bool:
        return self.method != "off"


def propose(tokens: Sequence[int], ngram: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens of
    `tokens`, for n from `ngram` down to 1 (the longest suffix that occurred before wins)."""
    size = len(tokens)
    for n in range(min(ngram, size - 1), 0, -1):
        suffix = list(tokens[size - n :])
        last = suffix[-1]
        for end in range(size - 2, n - 2, -1):  # `end`: where an earlier occurrence ends
            if tokens[end] == last and list(tokens[end - n + 1 : end + 1]) == suffix:
                return list(tokens[end + 1 : end + 1 + k])
    return []


def eligible(params: EffectiveParams, num_output_tokens: int) -> bool:
    """Whether a request's next tokens can be checked several at a time (this version: greedy,
    no penalties, no grammar, min_tokens reached)."""
    return (
        params.greedy
        and params.repetition_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and params.structured is None
        and num_output_tokens >= params.min_tokens
    )


def accepted(proposed: Sequence[int], model_tokens: Sequence[int]) -> int:
    """How many proposals the model confirmed: the longest prefix with p[i] == t[i] (t[i] is the
    model's token after the row that holds p[i - 1], or the last token for i = 0)."""
    m = 0
    while m < len(proposed) and proposed[m] == model_tokens[m]:
        m += 1
    return m


def keeps_proposing(num_proposed: int, num_accepted: int) -> bool:
    """A request stops proposing once enough proposals were checked and few held."""
    return num_proposed < PATIENCE or num_accepted >= LOW_ACCEPTANCE * num_proposed
