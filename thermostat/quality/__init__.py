"""Degeneration detection on generated text (repetition, loops, n-gram diversity, HTML ids).

`quality_report(text)` is the one call the server makes per completion; detectors arrive in a
later change and plug in here without touching the server.
"""

from __future__ import annotations

from typing import Any


def quality_report(text: str) -> dict[str, Any]:
    """The `quality` extension object of a completion: `{"degenerate": bool, "signals": {...}}`.

    `signals` maps a detector's name (the reason) to its measurement; `degenerate` is true when
    any detector fired. No detectors run yet: every text is reported as not degenerate."""
    del text  # inspected once detectors exist
    return {"degenerate": False, "signals": {}}
