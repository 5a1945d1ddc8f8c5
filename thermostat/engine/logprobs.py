"""A scored token's logprob, rank and most likely alternatives (`TokenLogprobs`), from a
log_softmax of raw logits: what the sampler reports per sampled token and the runner per prompt
token."""

from __future__ import annotations

from collections.abc import Callable

import torch

from thermostat.engine.steps import TokenLogprobs


def logprobs_of(lp: torch.Tensor, targets: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """Row i of `lp` [N, V] (a log_softmax of raw logits) scoring `targets[i]` ([N] int64), with
    its `ks[i]` most likely alternatives, best first (equal logprobs: the lower id first, so a
    row's alternatives do not depend on the rows beside it)."""
    chosen = lp.gather(1, targets[:, None])  # [N, 1]
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    tops = top_alternatives(lp, max(ks, default=0))
    columns = (targets.tolist(), chosen[:, 0].tolist(), ranks, tops)
    return [TokenLogprobs(t, c, r, top[:k]) for t, c, r, top, k in zip(*columns, ks, strict=True)]


def top_alternatives(lp: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Each row's k largest (id, value), by value descending, then id ascending. torch.topk
    breaks ties by the batch's shape; here a tie is broken by the id: topk(k + 1) settles the
    set unless the k-th and the next value are equal, and then the ids holding that value are
    looked up in the row (bfloat16 logits tie often)."""
    k = min(k, lp.shape[-1])
    if k == 0:
        return [[] for _ in range(lp.shape[0])]
    wide = min(k + 1, lp.shape[-1])
    values, indices = lp.topk(wide, dim=-1)
    tops = []
    for row, (vals, ids) in enumerate(zip(values.tolist(), indices.tolist(), strict=True)):
        pairs = list(zip(ids[:k], vals[:k], strict=True))
        if wide > k and vals[k - 1] == vals[k]:  # the boundary is a tie: the lowest ids win
            boundary = vals[k - 1]
            pairs = [(i, v) for i, v in pairs if v > boundary]
            tied = torch.nonzero(lp[row] == boundary).flatten().tolist()  # ids ascending
            pairs += [(i, boundary) for i in tied[: k - len(pairs)]]
        tops.append(sorted(pairs, key=lambda p: (-p[1], p[0])))
    return tops


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    prompt: list[int],
    start: int,
    hidden: torch.Tensor,
    k: int,
) -> dict[int, TokenLogprobs]:
    """The prompt tokens a chunk's rows score (`hidden` [n, hidden] from position `start`):
    position p's token is scored by the logits at position p - 1; {position: logprobs}."""
    last = min(start + hidden.shape[0], len(prompt) - 1)  # the last scoring position + 1
    if last <= start:
        return {}
    lp = torch.log_softmax(compute_logits(hidden[: last - start]).float(), dim=-1)
    targets = prompt[start + 1 : last + 1]
    scored = logprobs_of(lp, torch.tensor(targets, dtype=torch.int64), [k] * len(targets))
    return {start + 1 + i: row for i, row in enumerate(scored)}
