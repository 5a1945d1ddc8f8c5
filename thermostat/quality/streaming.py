"""Streaming analysis: `update(delta)` per generated piece, cheap enough to call per token.

Per update: the delta is tokenized incrementally (tokens.py); each new token and character
advances the tail-run counters of the three loop views (cycles.TailRuns: O(max period) per
item, however long the loop runs); `loop_detected` is re-derived. Nothing per update grows with
the text. `report()` adds what is cheap once but not per token (n-grams of the last W tokens,
compression of the last C characters, the HTML checks over the whole text) and equals
`analyze(text)`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from thermostat.quality.compression import compression_ratio
from thermostat.quality.config import DEFAULT, DetectorConfig
from thermostat.quality.cycles import CharTailRuns, TailCycle, TailRuns, best_cycle
from thermostat.quality.loops import (
    certain_loop,
    is_char_loop,
    is_counting_loop,
    is_loop,
    numbers_aside,
)
from thermostat.quality.markup import check_markup
from thermostat.quality.ngrams import NgramStats
from thermostat.quality.report import QualityReport
from thermostat.quality.tokens import IncrementalTokenizer
from thermostat.quality.verdict import Measurements, judge


@dataclass(frozen=True)
class StreamState:
    """After one update. `loop_detected`: the text now ends in an exact loop (the report's
    `loop` or `char_loop` flag), certain enough to stop the generation on."""

    chars: int
    tokens: int
    loop_detected: bool
    loop: TailCycle | None  # tail cycle over tokens (candidate: repeats >= 2)
    counting_loop: TailCycle | None  # the same, numbers aside
    char_loop: TailCycle | None  # tail cycle over characters


def _last_2p(recent: Sequence[str], head: str | None = None) -> Callable[[int], list[str]]:
    """The last 2p items, oldest first: `recent` (most recent first), then `head` if any."""

    def items(p: int) -> list[str]:
        newest = [] if head is None else [head]
        return [recent[k] for k in range(2 * p - 1 - len(newest), -1, -1)] + newest

    return items


class _TokenView:
    """Tail runs over tokens seen through `key`, with the pending (maybe cut-off) last token."""

    def __init__(
        self,
        config: DetectorConfig,
        key: Callable[[str], str],
        test: Callable[[TailCycle, DetectorConfig], bool],
    ) -> None:
        self.config, self.key, self.test = config, key, test
        self.runs = TailRuns(config.max_period_tokens)

    def push(self, token: str) -> None:
        self.runs.push(self.key(token))

    def cycle(self, pending: str) -> TailCycle | None:
        """The tail cycle, `pending` (the cut-off last word, or '') included."""
        if not pending:
            last_2p = _last_2p(self.runs.recent)
            return best_cycle(self.runs.runs, last_2p, lambda c: self.test(c, self.config))
        last = self.key(pending)
        last_2p = _last_2p(self.runs.recent, last)
        return best_cycle(self.runs.runs_with(last), last_2p, lambda c: self.test(c, self.config))


class StreamingAnalyzer:
    """Degeneration signals of a text that arrives in pieces."""

    def __init__(self, config: DetectorConfig = DEFAULT) -> None:
        self.config = config
        self._parts: list[str] = []
        self._chars = 0
        self._tokenizer = IncrementalTokenizer()
        self._complete_tokens = 0  # tokens followed by a safe cut
        self._exact = _TokenView(config, str, is_loop)
        self._counting = _TokenView(config, numbers_aside, is_counting_loop)
        self._char_runs = CharTailRuns(config.max_period_chars)
        self._window: deque[str] = deque(maxlen=config.ngram_window_tokens)
        self.state = StreamState(0, 0, False, None, None, None)

    @property
    def text(self) -> str:
        """Everything fed so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def update(self, delta: str) -> StreamState:
        """Take the next piece of text; returns the state after it."""
        if not delta:
            return self.state
        self._parts.append(delta)
        self._chars += len(delta)
        for ch in delta:
            self._char_runs.push(ch)
        for token in self._tokenizer.feed(delta):
            self._exact.push(token)
            self._counting.push(token)
            self._window.append(token)
            self._complete_tokens += 1
        pending = self._tokenizer.pending
        chars = self._char_runs
        char_loop = best_cycle(
            chars.runs, _last_2p(chars.recent), lambda c: is_char_loop(c, self.config)
        )
        loop = self._exact.cycle(pending)
        self.state = StreamState(
            chars=self._chars,
            tokens=self._complete_tokens + bool(pending),
            loop_detected=certain_loop(loop, char_loop, self.config),
            loop=loop,
            counting_loop=self._counting.cycle(pending),
            char_loop=char_loop,
        )
        return self.state

    def report(self) -> QualityReport:
        """The full report of the text so far; equal to `analyze(text, config)`."""
        config, text, pending = self.config, self.text, self._tokenizer.pending
        window = [*self._window, pending] if pending else list(self._window)
        recent = text[len(text) - min(len(text), config.compression_window_chars) :]
        m = Measurements(
            chars=self._chars,
            tokens=self.state.tokens,
            loop=self.state.loop,
            counting_loop=self.state.counting_loop,
            char_loop=self.state.char_loop,
            ngrams=NgramStats.of(
                window[len(window) - min(len(window), config.ngram_window_tokens) :]
            ),
            compression_ratio=compression_ratio(recent),
            compression_chars=len(recent),
            markup=check_markup(text),
        )
        return judge(m, config)
