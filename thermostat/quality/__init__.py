"""Degeneration detection on generated text: loops at the end, n-gram diversity,
compressibility, HTML id and tag consistency.

Offline: `analyze(text) -> QualityReport`. Online: `StreamingAnalyzer.update(delta)` per
generated piece (its `loop_detected` can stop a generation), `.report()` at the end (equal to
`analyze` of the same text). `quality_report(text)` is the one call the server makes per
completion. Pure Python (stdlib + numpy): the gateway uses it without an engine.
"""

from __future__ import annotations

from typing import Any

from thermostat.quality.analyze import analyze, measure
from thermostat.quality.config import DEFAULT, DetectorConfig
from thermostat.quality.cycles import TailCycle
from thermostat.quality.markup import MarkupReport, check_markup
from thermostat.quality.report import QualityReport
from thermostat.quality.streaming import StreamingAnalyzer, StreamState

__all__ = [
    "DEFAULT",
    "DetectorConfig",
    "MarkupReport",
    "QualityReport",
    "StreamState",
    "StreamingAnalyzer",
    "TailCycle",
    "analyze",
    "check_markup",
    "measure",
    "quality_report",
]


def quality_report(text: str) -> dict[str, Any]:
    """The `quality` extension object of a completion, JSON-able:
    `{"degenerate": bool, "signals": {...}, "reasons": [...], "flags": [...]}` (+ `"markup"`
    when the text contains HTML). `flags` names the detectors that fired (a small fixed set);
    `signals` holds every measurement whether or not it fired."""
    return analyze(text).to_dict()
