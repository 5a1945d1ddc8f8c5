"""`thermostat analyze [FILE|-] [--json]`: is this text degenerate, and why.

Exit status: 0 healthy, 1 degenerate, 2 the input could not be read (missing file, a
directory, not UTF-8). Registered in `thermostat/cli.py` as a subcommand module (`HELP`,
`EPILOG`, `add_arguments`, `run`); `add_parser(subparsers)` does the same on any argparse
subparsers object.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from thermostat.quality.analyze import analyze
from thermostat.quality.report import QualityReport

HELP = "check a text for degeneration: loops, repetition, broken HTML ids"
EPILOG = """examples:
  thermostat analyze answer.txt                 # signals and reasons; exit 1 if degenerate
  thermostat analyze page.html --json           # the `quality` object a completion carries
  some-client --prompt "..." | thermostat analyze -
  thermostat analyze out.txt && echo healthy

exit status: 0 healthy, 1 degenerate, 2 unreadable input.
Detectors: a loop at the end (exact, by token or character; or a numbered list that repeats
itself), 4-gram repetition with high compressibility, duplicate or dangling HTML ids,
unbalanced tags in a complete page. Thresholds: thermostat.quality.config.DetectorConfig.
"""

# signal name -> what it measures (shown in the table)
SIGNAL_HELP = {
    "chars": "characters",
    "tokens": "word/punctuation tokens",
    "loop_period": "tokens per cycle of the repetition at the end",
    "loop_repeats": "complete cycles",
    "loop_tokens": "tokens the repetition covers",
    "counting_loop_period": "the same, numbers counted as equal",
    "counting_loop_repeats": "",
    "counting_loop_tokens": "",
    "char_loop_period": "characters per cycle of the repetition at the end",
    "char_loop_repeats": "complete cycles",
    "char_loop_chars": "characters the repetition covers",
    "ngram_window": "tokens in the n-gram window (the last W)",
    "distinct_1": "unique / total 1-grams in the window",
    "distinct_2": "unique / total 2-grams",
    "distinct_3": "unique / total 3-grams",
    "seq_rep_4": "1 - unique / total 4-grams (Welleck et al. 2019)",
    "word_share": "tokens with a letter / tokens in the window",
    "compression_ratio": "zlib bytes / raw bytes of the last C characters",
    "compression_chars": "characters compressed",
    "html_complete": "a whole page, <html> to </html>",
    "html_duplicate_ids": "ids carried by two or more elements",
    "html_dangling_refs": "references to ids no element has",
    "html_unclosed_tags": "elements never closed",
    "html_stray_end_tags": "end tags with no open element",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", default="-", help="a UTF-8 text file, or - for stdin")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `analyze` to an argparse subparsers object; `args.run(args)` runs it."""
    p = subparsers.add_parser(
        "analyze",
        help=HELP,
        description=HELP,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(run=run)
    return p


def read_input(path: str) -> str:
    """The text of `path` ('-' = stdin); OSError or UnicodeDecodeError when unreadable."""
    if path == "-":
        return sys.stdin.buffer.read().decode("utf-8")
    with open(path, "rb") as f:
        return f.read().decode("utf-8")


def print_report(report: QualityReport, console: Console, source: str) -> None:
    table = Table(title=f"quality of {source}")
    table.add_column("signal")
    table.add_column("value", justify="right")
    table.add_column("meaning", style="dim")
    for name, value in report.signals.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        table.add_row(name, shown, SIGNAL_HELP.get(name, ""))
    console.print(table)
    if report.degenerate:
        console.print("[bold red]degenerate[/]")
        for reason in report.reasons:
            console.print(f"  - {reason}", markup=False, highlight=False)
    else:
        console.print("[bold green]healthy[/]: no detector fired")


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    source = "stdin" if args.file == "-" else args.file
    try:
        text = read_input(args.file)
    except UnicodeDecodeError as exc:
        err.print(f"[red]error:[/] {source} is not UTF-8 text ({exc.reason} at byte {exc.start})")
        return 2
    except OSError as exc:
        err.print(f"[red]error:[/] cannot read {source}: {exc.strerror or exc}")
        return 2
    report = analyze(text)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, ensure_ascii=False))
    else:
        print_report(report, Console(), source)
    return 1 if report.degenerate else 0
