"""The verdict on one text: the `quality` extension object of a completion."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from thermostat.quality.markup import MarkupReport

Signal = int | float | bool


@dataclass(frozen=True)
class QualityReport:
    """`degenerate` is true when any detector fired; `flags` names those detectors (a small
    fixed set: use it, not `signals`, as a metrics label); `reasons` says why, one sentence
    per detector; `signals` holds every measurement, fired or not."""

    degenerate: bool
    signals: dict[str, Signal]
    reasons: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    markup: MarkupReport | None = field(default=None, compare=True)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: `{"degenerate", "signals", "reasons", "flags"}` (+ `"markup"` for HTML)."""
        out: dict[str, Any] = {
            "degenerate": self.degenerate,
            "signals": dict(self.signals),
            "reasons": list(self.reasons),
            "flags": list(self.flags),
        }
        if self.markup is not None:
            m = self.markup
            out["markup"] = {
                "complete": m.complete,
                "duplicate_ids": list(m.duplicate_ids),
                "dangling_refs": [{"id": i, "attribute": a} for i, a in m.dangling_refs],
                "unclosed_tags": list(m.unclosed_tags),
                "stray_end_tags": list(m.stray_end_tags),
            }
        return out
