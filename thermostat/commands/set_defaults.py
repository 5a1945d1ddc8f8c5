"""`thermostat set-defaults MODEL_DIR`: fix a model's generation_config.json sampling values."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from thermostat.sampling.fields import SamplingParamError
from thermostat.sampling.generation_config import update_generation_config
from thermostat.sampling.recommendations import recommendation_for

HELP = "edit a model directory's generation_config.json (keeps a .bak)"
EPILOG = """examples:
  thermostat set-defaults ./my-model --temperature 0.6 --top-p 0.95
  thermostat set-defaults ./my-model --recommended       # the family's published values
  thermostat set-defaults ./my-model --top-k -1 --json

The old file is kept as generation_config.json.bak; the new one replaces it atomically.
Servers read the file at startup: restart them after the change.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="a Hugging Face model directory")
    p.add_argument("--temperature", type=float, help="0 makes the default greedy")
    p.add_argument("--top-p", type=float, help="in (0, 1]")
    p.add_argument("--top-k", type=int, help="-1 turns top-k off")
    p.add_argument("--min-p", type=float, help="in [0, 1]")
    p.add_argument("--repetition-penalty", type=float, help="> 0; 1 is off")
    p.add_argument(
        "--recommended",
        action="store_true",
        help="write the model family's published recommendation (explicit flags win)",
    )
    p.add_argument("--json", action="store_true", help="print the change as JSON")


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    updates: dict = {}
    if args.recommended:
        try:
            config = json.loads((Path(args.model_dir) / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            console.print(f"[red]error:[/] cannot read config.json of {args.model_dir}: {exc}")
            return 2
        rec = recommendation_for(config)
        if rec is None:
            console.print("[red]error:[/] no published recommendation is known for this family")
            return 2
        updates |= rec.values
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if getattr(args, name) is not None:
            updates[name] = getattr(args, name)
    if not updates:
        console.print(
            "[red]error:[/] nothing to set: give --temperature/--top-p/... or --recommended"
        )
        return 2
    try:
        change = update_generation_config(args.model_dir, updates)
    except (SamplingParamError, ValueError) as exc:
        console.print(f"[red]error:[/] {exc} (nothing was written)")
        return 2
    if args.json:
        print(
            json.dumps(
                {
                    "path": str(change.path),
                    "backup": str(change.backup) if change.backup else None,
                    "changed": {
                        k: {"before": b, "after": a} for k, (b, a) in change.changed.items()
                    },
                    "after": change.after,
                },
                indent=2,
            )
        )
        return 0
    table = Table(title=str(change.path))
    for col in ("key", "before", "after"):
        table.add_column(col)
    for key, (before, after) in change.changed.items():
        table.add_row(key, "-" if before is None else str(before), str(after))
    Console().print(table if change.changed else "no change: the file already had these values")
    if change.backup:
        Console().print(f"previous file kept as {change.backup}; restart servers to apply")
    return 0
