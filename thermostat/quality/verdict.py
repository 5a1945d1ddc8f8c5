"""From measurements to a verdict: which detectors fire, and the sentence that says why.

`Measurements` is what both the one-shot `analyze` and the `StreamingAnalyzer` compute; `judge`
turns it into a `QualityReport` the same way for both, so they cannot disagree on a verdict.

| flag               | fires when                                                    |
|--------------------|---------------------------------------------------------------|
| loop               | exact token cycle at the end (loops.py)                       |
| char_loop          | exact character cycle, when the token view did not fire       |
| counting_loop      | token cycle, numbers aside, when neither exact view fired     |
| repetitive         | seq-rep-4 high, compression ratio low, window mostly words    |
| html_duplicate_ids | an id carried by two elements                                 |
| html_dangling_refs | a reference to an id no element has, in a complete page       |
| html_unbalanced    | unclosed elements or stray end tags, in a complete page       |
"""

from __future__ import annotations

from dataclasses import dataclass

from thermostat.quality.config import DetectorConfig
from thermostat.quality.cycles import TailCycle
from thermostat.quality.loops import is_char_loop, is_counting_loop, is_loop
from thermostat.quality.markup import MarkupReport
from thermostat.quality.ngrams import NgramStats
from thermostat.quality.report import QualityReport, Signal


@dataclass(frozen=True)
class Measurements:
    chars: int  # characters of the whole text
    tokens: int  # word/punctuation tokens of the whole text
    loop: TailCycle | None  # tail cycle over tokens (candidate: repeats >= 2)
    counting_loop: TailCycle | None  # the same with numbers aside
    char_loop: TailCycle | None  # tail cycle over characters
    ngrams: NgramStats  # over the last W tokens
    compression_ratio: float  # over the last C characters
    compression_chars: int  # characters in that window
    markup: MarkupReport | None  # None: no HTML tags in the text


def _preview(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _names(items: list[str] | tuple[str, ...], limit: int = 8) -> str:
    distinct = list(dict.fromkeys(items))
    more = f" (+{len(distinct) - limit} more)" if len(distinct) > limit else ""
    return ", ".join(distinct[:limit]) + more


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _cycle_signals(prefix: str, c: TailCycle | None, span_name: str) -> dict[str, Signal]:
    return {
        f"{prefix}_period": c.period if c else 0,  # items per cycle
        f"{prefix}_repeats": c.repeats if c else 0,  # complete cycles at the end
        f"{prefix}_{span_name}": c.span if c else 0,  # items covered
    }


def signals_of(m: Measurements) -> dict[str, Signal]:
    """The flat `signals` object: measurement name -> value (0 where nothing repeats)."""
    g = m.ngrams
    out: dict[str, Signal] = {
        "chars": m.chars,
        "tokens": m.tokens,
        **_cycle_signals("loop", m.loop, "tokens"),
        **_cycle_signals("counting_loop", m.counting_loop, "tokens"),
        **_cycle_signals("char_loop", m.char_loop, "chars"),
        "ngram_window": g.window,  # tokens
        "distinct_1": round(g.distinct_1, 4),
        "distinct_2": round(g.distinct_2, 4),
        "distinct_3": round(g.distinct_3, 4),
        "seq_rep_4": round(g.seq_rep_4, 4),
        "word_share": round(g.word_share, 4),
        "compression_ratio": round(m.compression_ratio, 4),
        "compression_chars": m.compression_chars,
    }
    if m.markup is not None:
        mk = m.markup
        out |= {
            "html_complete": mk.complete,
            "html_duplicate_ids": len(mk.duplicate_ids),
            "html_dangling_refs": len(mk.dangling_refs),
            "html_unclosed_tags": len(mk.unclosed_tags),
            "html_stray_end_tags": len(mk.stray_end_tags),
        }
    return out


def _loop_finding(m: Measurements, config: DetectorConfig) -> tuple[str, str] | None:
    """The first loop view that fires: exact tokens, exact characters (together: streaming's
    `loop_detected`), then tokens with numbers aside."""
    if m.loop is not None and is_loop(m.loop, config):
        c = m.loop
        return "loop", (
            f"ends in a loop: a {c.period}-token cycle repeated {c.repeats} times "
            f"({c.span} tokens): {_preview(' '.join(c.unit))}"
        )
    if m.char_loop is not None and is_char_loop(m.char_loop, config):
        c = m.char_loop
        return "char_loop", (
            f"ends in a loop: a {c.period}-character cycle repeated {c.repeats} "
            f"times ({c.span} characters): {_preview(''.join(c.unit))}"
        )
    if m.counting_loop is not None and is_counting_loop(m.counting_loop, config):
        c = m.counting_loop
        return "counting_loop", (
            f"ends in a counting loop: a {c.period}-token cycle repeated "
            f"{c.repeats} times ({c.span} tokens), the same but for its numbers (#): "
            f"{_preview(' '.join(c.unit))}"
        )
    return None


def _repetitive(m: Measurements, config: DetectorConfig) -> tuple[str, str] | None:
    g = m.ngrams
    judged = (
        g.window >= config.min_ngram_tokens and m.compression_chars >= config.min_compression_chars
    )
    if not (judged and g.word_share >= config.min_word_share):
        return None
    if g.seq_rep_4 > config.max_seq_rep_4 and m.compression_ratio < config.min_compression_ratio:
        return "repetitive", (
            f"repetitive: {g.seq_rep_4:.0%} of the 4-grams in the last {g.window} tokens "
            f"repeat (seq-rep-4 > {config.max_seq_rep_4}) and the last {m.compression_chars} "
            f"characters compress to {m.compression_ratio:.0%} "
            f"(zlib; < {config.min_compression_ratio:.0%})"
        )
    return None


def _markup_findings(mk: MarkupReport, config: DetectorConfig) -> list[tuple[str, str]]:
    found = []
    if len(mk.duplicate_ids) > config.max_duplicate_ids:
        n = len(mk.duplicate_ids)
        found.append(
            ("html_duplicate_ids", f"{_count(n, 'duplicate HTML id')}: {_names(mk.duplicate_ids)}")
        )
    if mk.complete and len(mk.dangling_refs) > config.max_dangling_refs:
        refs = [f"{ident} ({attr})" for ident, attr in mk.dangling_refs]
        found.append(
            (
                "html_dangling_refs",
                f"{_count(len(refs), 'reference')} to HTML ids that no element has: {_names(refs)}",
            )
        )
    unbalanced = len(mk.unclosed_tags) + len(mk.stray_end_tags)
    if mk.complete and unbalanced > config.max_unbalanced_tags:
        parts = []
        if mk.unclosed_tags:
            n = len(mk.unclosed_tags)
            parts.append(f"{_count(n, 'unclosed element')} ({_names(mk.unclosed_tags)})")
        if mk.stray_end_tags:
            n = len(mk.stray_end_tags)
            parts.append(f"{_count(n, 'stray end tag')} ({_names(mk.stray_end_tags)})")
        found.append(("html_unbalanced", "unbalanced HTML: " + "; ".join(parts)))
    return found


def judge(m: Measurements, config: DetectorConfig) -> QualityReport:
    """The report: each detector that fires adds its flag and one reason."""
    found = [f for f in (_loop_finding(m, config), _repetitive(m, config)) if f is not None]
    if m.markup is not None:
        found.extend(_markup_findings(m.markup, config))
    return QualityReport(
        degenerate=bool(found),
        signals=signals_of(m),
        reasons=tuple(reason for _, reason in found),
        flags=tuple(flag for flag, _ in found),
        markup=m.markup,
    )
