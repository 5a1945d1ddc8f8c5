"""mkdocs hooks: the pages written from the code and the results, never by hand.

- `reference/cli.md` is generated from `thermostat.cli.build_parser()`: every command, its
  positional arguments and every flag with its default and help, as `--help` prints them.
- `changelog.md` is the repository's `CHANGELOG.md`.
- `benchmarks.md` carries the marker `<!-- results -->`; it is replaced by one table block per
  JSON file in `benchmarks/results/` (the latest run of each benchmark: command, commit, CPU and
  date; the history is git's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
RESULTS_MARKER = "<!-- results -->"
CLI_PAGE = "reference/cli.md"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        value = f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(columns: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |"]
    lines.append("|" + "---|" * len(columns))
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _default(action: argparse.Action) -> str:
    if isinstance(action.default, bool) or (action.option_strings and action.nargs == 0):
        return "on" if action.default else "off"
    if action.default in (None, argparse.SUPPRESS):
        return "-"
    return f"`{action.default}`"


def _argument(action: argparse.Action) -> list[Any]:
    """One table row: the flags (or the positional's name) with the value's form, default, help."""
    metavar = argparse.HelpFormatter("x")._format_args(action, action.dest.upper())
    if action.option_strings:
        names = ", ".join(f"`{name}`" for name in action.option_strings)
        name = f"{names} `{metavar}`" if action.nargs != 0 else names
    else:
        name = f"`{metavar}`"
    help_text = (action.help or "").replace("%(default)s", str(action.default))
    return [name, _default(action), help_text.replace("%%", "%")]


def cli_reference(parser: argparse.ArgumentParser) -> str:
    """The reference page: one section per subcommand, every argument in a table."""
    lines = [
        "# Command-line reference",
        "",
        "Generated from the argparse definitions (`thermostat/cli.py` and each command's",
        "`add_arguments`) when the site is built: `thermostat COMMAND --help` prints the same.",
        "",
    ]
    for name, sub in _subcommands(parser).items():
        lines += [f"## thermostat {name}", "", sub.description or "", ""]
        lines += ["```text", sub.format_usage().strip(), "```", ""]
        actions = [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]
        lines += _table(["argument", "default", "what it does"], [_argument(a) for a in actions])
        if sub.epilog:
            lines += ["", "```text", sub.epilog.strip("\n"), "```"]
        lines.append("")
    return "\n".join(lines)


def results_markdown(results_dir: Path) -> str:
    """Every benchmark's latest recorded run, as written by `benchmarks/results.py`."""
    blocks: list[str] = []
    for path in sorted(results_dir.glob("*.json")):
        result = json.loads(path.read_text())
        dirty = " (with uncommitted changes)" if result.get("dirty") else ""
        lines = [
            f"### {result['title']}",
            "",
            f"`{result['command']}`  ",
            f"commit `{result['commit']}`{dirty}, {result['cpu']}, "
            f"{result['threads']} threads, {result['date']}",
            "",
        ]
        for table in result["tables"]:
            if table.get("title"):
                lines += [f"**{table['title']}**", ""]
            lines += _table(table["columns"], table["rows"]) + [""]
        if result.get("notes"):
            lines += [result["notes"], ""]
        blocks.append("\n".join(lines))
    if not blocks:
        return "No benchmark has recorded a result yet."
    return "\n".join(blocks)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    from thermostat.cli import build_parser

    files.append(File.generated(config, CLI_PAGE, content=cli_reference(build_parser())))
    changelog = (ROOT / "CHANGELOG.md").read_text()
    files.append(File.generated(config, "changelog.md", content=changelog))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if RESULTS_MARKER in markdown:
        return markdown.replace(RESULTS_MARKER, results_markdown(RESULTS_DIR))
    return markdown
