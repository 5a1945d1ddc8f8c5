"""One-shot analysis of a finished text: `analyze(text) -> QualityReport`."""

from __future__ import annotations

from thermostat.quality.compression import compression_ratio
from thermostat.quality.config import DEFAULT, DetectorConfig
from thermostat.quality.loops import char_cycle, token_cycle
from thermostat.quality.markup import check_markup
from thermostat.quality.ngrams import NgramStats
from thermostat.quality.report import QualityReport
from thermostat.quality.tokens import ends_in_word, tokenize
from thermostat.quality.verdict import Measurements, judge


def measure(text: str, config: DetectorConfig = DEFAULT) -> Measurements:
    """Every measurement the detectors judge, computed over the whole text at once."""
    tokens = tokenize(text)
    partial = ends_in_word(text)
    recent = text[len(text) - min(len(text), config.compression_window_chars) :]
    return Measurements(
        chars=len(text),
        tokens=len(tokens),
        loop=token_cycle(tokens, partial, config),
        counting_loop=token_cycle(tokens, partial, config, counting=True),
        char_loop=char_cycle(text, config),
        ngrams=NgramStats.of(tokens[len(tokens) - min(len(tokens), config.ngram_window_tokens) :]),
        compression_ratio=compression_ratio(recent),
        compression_chars=len(recent),
        markup=check_markup(text),
    )


def analyze(text: str, config: DetectorConfig = DEFAULT) -> QualityReport:
    """Is `text` degenerate, and why: loops at the end, low n-gram diversity with high
    compressibility, inconsistent HTML. Pure and deterministic; equal to a
    `StreamingAnalyzer(config)` fed the same text in any pieces, then `.report()`."""
    return judge(measure(text, config), config)
