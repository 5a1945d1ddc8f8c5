"""CLI commands beyond `serve`: each module exposes `add_arguments(parser)` and
`run(args) -> int` (0 success/healthy, 1 a finding or failure, 2 bad usage)."""

from __future__ import annotations
