"""What counts as a loop: three views of the tail repetition (cycles.py) and their thresholds.

| view          | items                            | fires when (DetectorConfig defaults)          |
|---------------|----------------------------------|-----------------------------------------------|
| loop          | tokens, exact                    | language, repeats >= 3, span >= 32 tokens     |
| counting_loop | tokens, all numbers count as one | language, repeats >= 12, span >= 80 tokens    |
| char_loop     | characters, whitespace included  | repeats >= 3, span >= 48 / 160 / 800 chars    |

A cycle is *language* when it has a letter outside markup tags. Other cycles are what healthy
text is full of: separator lines ("-----"), indentation, closing tags ("</td></tr></table>"),
table rows without words ("<td>✔</td>"), number tables ("1, 40, 1, 40"). Tokens cannot see
the line breaks between such repeats, so only the character view judges them: 160 characters
for symbols and markup, 800 for cycles with digits (healthy code has long number tables).
A counting loop is a list that keeps going with the same content ("Step 7: Repeat the last
step.", "8. Apples"): exact cycles miss it because its number changes every cycle.
`loop` and `char_loop` are exact repetition: certain, they set `loop_detected` in streaming.

Offline metrics over a model's token ids (`ends_in_loop`, `loop_in_tail`; tools/demo_sweep.py)
use the `loop` view with the ids as items and no language test: ids carry no text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from thermostat.quality.config import DEFAULT, DetectorConfig
from thermostat.quality.cycles import Runs, TailCycle, best_cycle, tail_runs
from thermostat.quality.tokens import has_letter

NUMBER = "#"  # what every number becomes in the counting view


_TAG_RE = re.compile(r"<[^<>]*>")


def is_language(unit: tuple[str, ...]) -> bool:
    """A cycle of language: a letter outside markup tags. The unit is a rotation of the cycle,
    so it is rotated to start at its first '<' before complete tags are removed."""
    text = "".join(unit)
    start = text.find("<")
    if start > 0:
        text = text[start:] + text[:start]
    return has_letter((_TAG_RE.sub("", text),))


def numbers_aside(token: str) -> str:
    """The counting view of a token: any number (decimal digits only) becomes `NUMBER`."""
    return NUMBER if token.isdecimal() else token


def is_long_loop(cycle: TailCycle, config: DetectorConfig) -> bool:
    """Enough cycles covering enough items: the `loop` thresholds, whatever the items are."""
    return cycle.repeats >= config.min_loop_repeats and cycle.span >= config.min_loop_tokens


def is_loop(cycle: TailCycle, config: DetectorConfig) -> bool:
    return is_long_loop(cycle, config) and is_language(cycle.unit)


def is_counting_loop(cycle: TailCycle, config: DetectorConfig) -> bool:
    return (
        config.counting_loops
        and cycle.repeats >= config.min_counting_loop_repeats
        and cycle.span >= config.min_counting_loop_tokens
        and is_language(cycle.unit)
    )


def is_char_loop(cycle: TailCycle, config: DetectorConfig) -> bool:
    if cycle.repeats < config.min_char_loop_repeats:
        return False
    if is_language(cycle.unit):
        return cycle.span >= config.min_char_loop_chars
    if any(ch.isdigit() for ch in cycle.unit):
        return cycle.span >= config.min_number_loop_chars
    return cycle.span >= config.min_symbol_loop_chars


def certain_loop(
    loop: TailCycle | None, char_loop: TailCycle | None, config: DetectorConfig
) -> bool:
    """Exact repetition at the end, by token or by character: stop generating."""
    return (loop is not None and is_loop(loop, config)) or (
        char_loop is not None and is_char_loop(char_loop, config)
    )


# ---- one-shot: the whole sequence at once (streaming keeps the same runs item by item) ----


def _reaches_start(runs: Runs, length: int) -> bool:
    """Some run covers its whole window, so it may continue further back."""
    return any(run + p >= length for p, run in runs.items())


def token_cycle(
    tokens: list[str], partial: bool, config: DetectorConfig, counting: bool = False
) -> TailCycle | None:
    """The tail cycle over tokens (`counting`: in the counting view); `partial`: the text ends
    inside a word, so the last token may be cut off and matches as a prefix. Looks at the
    last tokens first and at more only while a run reaches the start of what it looked at."""
    width = 8 * config.max_period_tokens + 256
    while True:
        window = tokens[len(tokens) - min(width, len(tokens)) :]
        items = [numbers_aside(t) for t in window] if counting else window
        vocab: dict[str, int] = {}
        ids = np.fromiter((vocab.setdefault(t, len(vocab)) for t in items), np.int64, len(items))
        last_matches = None
        if partial and items:
            extending = [i for t, i in vocab.items() if t.startswith(items[-1])]
            before = ids[max(0, len(ids) - 1 - config.max_period_tokens) : len(ids) - 1][::-1]
            last_matches = np.isin(before, extending)
        runs = tail_runs(ids, config.max_period_tokens, last_matches)
        if len(window) == len(tokens) or not _reaches_start(runs, len(window)):
            break
        width *= 8
    test = is_counting_loop if counting else is_loop
    return best_cycle(runs, lambda p: items[-2 * p :], lambda c: test(c, config))


def char_cycle(text: str, config: DetectorConfig) -> TailCycle | None:
    """The tail cycle over characters (code points); the tail first, as `token_cycle`."""
    width = 8 * config.max_period_chars + 256
    while True:
        window = text[len(text) - min(width, len(text)) :]
        codes = np.frombuffer(window.encode("utf-32-le", "surrogatepass"), np.uint32)
        runs = tail_runs(codes, config.max_period_chars)
        if len(window) == len(text) or not _reaches_start(runs, len(window)):
            break
        width *= 8
    return best_cycle(runs, lambda p: window[-2 * p :], lambda c: is_char_loop(c, config))


# ---- over model token ids: the `loop` view without the language test ----


def ends_in_loop(token_ids: Sequence[int], config: DetectorConfig = DEFAULT) -> TailCycle | None:
    """The loop `token_ids` ends in, or None: among the tail cycles with period up to
    `max_period_tokens` that pass `is_long_loop`, the one with the longest span, then the
    shortest period. The cycle's unit holds the ids as decimal strings."""
    tail = token_ids[len(token_ids) - min(len(token_ids), 2 * config.max_period_tokens) :]
    items = [str(t) for t in tail]
    runs = tail_runs(np.asarray(token_ids, dtype=np.int64), config.max_period_tokens)
    cycle = best_cycle(runs, lambda p: items[-2 * p :], lambda c: is_long_loop(c, config))
    return cycle if cycle is not None and is_long_loop(cycle, config) else None


def loop_in_tail(
    token_ids: Sequence[int], window: int, config: DetectorConfig = DEFAULT
) -> TailCycle | None:
    """A loop lying wholly inside the last `window` ids, which may stop before the end (the
    sequence broke out of it): the loop the longest prefix of that window ends in, or None."""
    tail = token_ids[len(token_ids) - min(len(token_ids), window) :]
    for end in range(len(tail), config.min_loop_tokens - 1, -1):
        cycle = ends_in_loop(tail[:end], config)
        if cycle is not None:
            return cycle
    return None
