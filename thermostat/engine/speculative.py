"""Speculative decoding: a request proposes tokens, and the model checks them in the step that
computes its next token. Proposers: prompt lookup (`ngram`: the tokens that followed the last n
tokens the last time they occurred in the prompt or the output) and the checkpoint's
multi-token-prediction layer (`mtp`, DeepSeek-V3: models/next_n.py; the runner runs it over
every row of a step and it drafts one token, `draft_inputs`).

A request that speculates schedules `[last, p1 .. pk]` (its last sampled token and k proposals);
the runner computes every one of them as a decode row of its own (the same attention and the
same per-row arithmetic as a plain decode step at that position, so the logits are the same bits
with speculation on or off), and draws the model's token at each row: t0 follows `last`, t1
follows p1, ... Each row's distribution is the fully processed one at its position, as if the
proposals before it had been sampled: penalties count them, a grammar has consumed them (the
scheduler's `Constraint.lookahead`), a seeded request draws from its generator in row order.
The proposals are accepted while they equal the model's tokens; the step emits t0 .. tm (m
proposals confirmed, then the model's own next token) and keeps the K/V of `last` and p1 .. pm.
Rejected proposals leave rows past the request's computed tokens, which the next steps overwrite.

Why the output keeps its distribution. A proposal is a single token x (a point mass), and the
row's token t is drawn from the row's distribution p, so x is accepted with probability p(x), and
on a rejection the emitted t is distributed as p without x, renormalised: exactly the rejection
sampling of speculative decoding with a point-mass draft (accept with min(1, p(x) / q(x)) = p(x),
resample from the residual max(0, p - q)). For greedy rows t is the argmax: accepted while the
proposal is the model's choice. A seeded request's generator is set back after a rejection to
where the emitted tokens left it, so every emitted token took the same draws as without
speculation: greedy and seeded output are the same with speculation on or off.

Requests propose only while at most `max_running` run, after `min_tokens` (stop tokens are
banned until then), and not on caches with window pools (DeepSeek-V4's compressors keep state a
rejected token would change).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from thermostat.sampling.params import EffectiveParams

if TYPE_CHECKING:
    from thermostat.engine.steps import ScheduledChunk

METHODS = ("off", "ngram", "mtp")  # mtp: the checkpoint's next-n layers (models/next_n.py)
# Proposals only while at most this many requests run: a decode step reads the weights once
# whatever its rows, so at a few sequences checking k more tokens costs little (k = 4: about 1.05x
# a plain step at batch 1), but at 8 sequences it costs 2.7x (benchmarks/bench_speculative.py).
MAX_RUNNING = 4
LOW_ACCEPTANCE = 0.1  # below this share, after PATIENCE proposed tokens, a request stops proposing
PATIENCE = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "off"  # off | ngram | mtp
    k: int = 4  # tokens proposed per step at most
    ngram: int = 3  # the longest suffix matched; shorter ones down to 1 are tried in turn
    max_running: int = MAX_RUNNING  # requests propose only while at most this many run

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative must be one of {', '.join(METHODS)}, got {self.method!r}"
            )
        if min(self.k, self.ngram, self.max_running) < 1:
            raise ValueError(
                "speculative k, ngram and max_running must be >= 1, "
                f"got {self.k}, {self.ngram}, {self.max_running}"
            )

    @property
    def on(self) -> bool:
        return self.method != "off"


def no_next_n(path: object) -> str:
    """Why `--speculative mtp` cannot serve the model at `path`."""
    return (
        f"--speculative mtp: {path} has no multi-token-prediction layers "
        "(num_nextn_predict_layers in config.json; DeepSeek-V3 checkpoints have one)"
    )


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
    """Whether a request's next tokens can be checked several at a time: once `min_tokens` are
    out (before that a stop token's ban depends on the row)."""
    return num_output_tokens >= params.min_tokens


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


def draft_inputs(
    chunks: Sequence[ScheduledChunk],
    emitted: Mapping[str, list[int]],
    sequence: Callable[[str], list[int]],
) -> tuple[list[int], list[int], list[str]]:
    """`--speculative mtp`: the next-n layer's inputs for a step's rows (chunks in the step's
    order), as (each row's next token, the row each sampling request drafts from, those
    requests). A row's next token is the chunk's next input; at a sampled row, the token drawn
    there (`emitted`: a sampling chunk's tokens this step, in order); at the end of a prefill
    chunk that does not catch up, the sequence's next token. Rows past a rejected proposal get
    a stand-in (later steps overwrite their cache slots). A request drafts from the row of its
    last emitted token."""
    next_ids: list[int] = []
    rows: list[int] = []
    drafting: list[str] = []
    offset = 0
    for chunk in chunks:
        n = len(chunk.token_ids)
        ahead = [*chunk.token_ids[1:], 0]  # row j's next token; the last one to fill in
        tokens = emitted.get(chunk.req_id)
        if tokens is not None:
            if chunk.proposed:  # row j's next token is the one drawn there
                ahead[: len(tokens)] = tokens
            else:
                ahead[-1] = tokens[0]
            rows.append(offset + (len(tokens) - 1 if chunk.proposed else n - 1))
            drafting.append(chunk.req_id)
        else:
            whole, end = sequence(chunk.req_id), chunk.start + n
            ahead[-1] = whole[end] if end < len(whole) else 0
        next_ids.extend(ahead)
        offset += n
    return next_ids, rows, drafting
