"""Repetition at the end of a sequence: the loop signature of greedy decoding.

Holtzman et al. 2019 ("The Curious Case of Neural Text Degeneration", fig. 1): greedy and
beam search fall into repetition loops and stay there until the length limit, so the *end* of
the text repeats. For a sequence s[0..L) and a period p >= 1:

| name          | definition                                                                 |
|---------------|----------------------------------------------------------------------------|
| run(p)        | consecutive positions i = L-1, L-2, ... (i >= p) with s[i] == s[i-p]        |
| span(p)       | run(p) + p: items at the end covered by the repetition (last cycle partial) |
| repeats(p)    | span(p) // p: complete cycles in the span                                   |

The final item may be cut off (text that stops mid-word): it matches when it is a prefix of
the item one period earlier. A period is a candidate when repeats >= 2 (run >= p); the
reported cycle is the candidate that passes the caller's test, then covers the longest span,
then is shortest. Runs are kept as `{period: run}` for the periods whose run is not 0: in
healthy text the last item matches only a few earlier ones, so this stays small.

`tail_runs` computes the runs of a whole sequence at once (numpy; the tail first, the whole
sequence only when the repetition reaches further back); `TailRuns` maintains the same numbers
item by item, in one C-level scan of the last max_period items plus the matches, for streaming.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Runs = dict[int, int]  # period -> run, only runs > 0


@dataclass(frozen=True)
class TailCycle:
    """The repetition at the end of a sequence; `unit` is one cycle, in the order it started."""

    period: int  # items per cycle
    span: int  # items covered at the end, last partial cycle included
    unit: tuple[str, ...]

    @property
    def repeats(self) -> int:
        """Complete cycles in the span."""
        return self.span // self.period


Qualifies = Callable[[TailCycle], bool]  # is this repetition a loop (by the caller's thresholds)?


def _run_before_last(seq: np.ndarray, p: int) -> int:
    """Consecutive matches s[i] == s[i-p] for i = L-2, L-3, ... (the last item excluded)."""
    n = len(seq) - 1
    width = min(n, 4 * p + 64)  # look at the tail first; widen only while the run reaches back
    while True:
        tail = seq[n - width : n]
        eq = tail[p:] == tail[:-p]
        false = np.flatnonzero(~eq)
        run = int(eq.size) if false.size == 0 else int(eq.size - 1 - false[-1])
        if run < eq.size or width == n:
            return run
        width = min(n, 4 * width)


def tail_runs(seq: np.ndarray, max_period: int, last_matches: np.ndarray | None = None) -> Runs:
    """The non-zero runs for p = 1..max_period over an integer array `seq`.

    `last_matches[p-1]`, when given, says whether the last item matches the one p earlier
    (the cut-off-word rule); otherwise items compare by equality."""
    n = len(seq)
    if n < 2:
        return {}
    before = seq[max(0, n - 1 - max_period) : n - 1][::-1]  # before[p-1] = s[L-1-p]
    matches = before == seq[-1] if last_matches is None else last_matches[: len(before)]
    return {int(p): 1 + _run_before_last(seq, int(p)) for p in np.flatnonzero(matches) + 1}


class TailRuns:
    """The non-zero runs for p = 1..max_period over a sequence that grows one item at a time.

    Per item: the positions where the same item occurred within the last max_period (kept
    per item value) are exactly the periods whose run grows; every other run drops to 0."""

    def __init__(self, max_period: int) -> None:
        self.max_period = max_period
        self.length = 0  # items pushed
        self.runs: Runs = {}
        self.recent: deque[str] = deque(maxlen=2 * max_period)  # most recent first
        self._seen: dict[str, list[int]] = {}  # item -> its positions, the last max_period only

    def push(self, item: str) -> None:
        n, runs, out = self.length, self.runs, {}
        seen = self._seen.get(item)
        if seen is None:
            self._seen[item] = [n]
        else:
            while seen and n - seen[0] > self.max_period:  # forget what no period reaches
                seen.pop(0)
            for pos in seen:
                out[n - pos] = runs.get(n - pos, 0) + 1
            seen.append(n)
        self.runs = out
        self.recent.appendleft(item)
        self.length = n + 1

    def runs_with(self, last: str) -> Runs:
        """The runs if a cut-off `last` were pushed: it matches any earlier item it is a
        prefix of. Only p = 1 and periods already running can become candidates (run >= p),
        so only those are computed."""
        recent, runs = self.recent, self.runs
        out = {p: runs.get(p, 0) + 1 for p in (1, *runs) if p <= len(recent)}
        return {p: r for p, r in out.items() if recent[p - 1].startswith(last)}


class CharTailRuns:
    """`TailRuns` over characters: `recent` is a string, searched with `str.find`."""

    def __init__(self, max_period: int) -> None:
        self.max_period = max_period
        self.runs: Runs = {}
        self.recent = ""  # the last 2*max_period characters, most recent first

    def push(self, item: str) -> None:
        recent, runs, out = self.recent, self.runs, {}
        limit = min(len(recent), self.max_period)
        i = recent.find(item, 0, limit)
        while i >= 0:
            out[i + 1] = runs.get(i + 1, 0) + 1
            i = recent.find(item, i + 1, limit)
        self.runs = out
        self.recent = item + recent[: 2 * self.max_period - 1]


def unit_of(last_2p: Sequence[str], period: int, span: int) -> tuple[str, ...]:
    """The cycle as it started, from the last 2*period items (oldest first, span >= 2*period).

    Inside the span the sequence has period p, so item j of the first cycle (position L-span+j)
    equals the item at L-2p + ((j - span) mod p): within the last complete cycle before the
    (maybe cut-off) final item."""
    return tuple(last_2p[(j - span) % period] for j in range(period))


def best_cycle(
    runs: Runs, last_2p: Callable[[int], Sequence[str]], qualifies: Qualifies
) -> TailCycle | None:
    """The reported cycle among candidates (repeats >= 2): the first that qualifies in order
    of longest span, then shortest period; else the first in that order. `last_2p(p)` gives
    the last 2p items, oldest first. None when no period repeats twice."""
    order = sorted((-(run + p), p) for p, run in runs.items() if run >= p)
    first: TailCycle | None = None
    for neg_span, p in order:
        cycle = TailCycle(p, -neg_span, unit_of(last_2p(p), p, -neg_span))
        if qualifies(cycle):
            return cycle
        first = first or cycle
    return first
