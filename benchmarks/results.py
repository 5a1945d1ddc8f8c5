"""A benchmark's result as JSON: the latest run of each benchmark, with what it takes to read it
(the command, the commit, the CPU, the threads and the date); the history is git's.

    from results import Table, record   # a script run as `python benchmarks/x.py`

    record("bench_x", "what it measures", [Table("tok/s, medians", ["batch", "tok/s"], rows)])

writes `benchmarks/results/bench_x.json` (or into `$THERMOSTAT_BENCH_RESULTS`, or the
`results_dir` given), replacing the previous run's:

    {"benchmark": "bench_x", "title": ..., "command": "python benchmarks/x.py --batches 1",
     "commit": "43032fa", "dirty": false, "cpu": "AMD EPYC (family 25 model 17; AVX-512 BF16,
     no AMX)", "threads": 2, "date": "2026-12-07T10:31:02Z",
     "tables": [{"title": ..., "columns": [...], "rows": [[...], ...]}], "notes": ""}

Cells are numbers (as the caller rounded them), strings or null (a non-finite float is written
as null). Only the standard library: the scripts that run under another environment (the
peers' llama.cpp venv) import it too.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / "benchmarks" / "results"
ENV_DIR = "THERMOSTAT_BENCH_RESULTS"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

Cell = str | int | float | None


@dataclass
class Table:
    """One table of a result: its title, its column names and its rows (one cell per column)."""

    title: str
    columns: list[str]
    rows: list[list[Cell]]


def show(*tables: Table) -> None:
    """Print tables on the terminal (rich, imported here: the rest of this module is the standard
    library's)."""
    from rich.console import Console
    from rich.table import Table as RichTable

    for table in tables:
        shown = RichTable(title=table.title)
        for column in table.columns:
            shown.add_column(column)
        for row in table.rows:
            shown.add_row(*(str(c) for c in row))
        Console().print(shown)


def _cell(value: object) -> Cell:
    if value is None or isinstance(value, str | int):
        return value  # a bool is an int: written as true or false
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    item = getattr(value, "item", None)  # a numpy or torch scalar
    if callable(item):
        return _cell(item())
    raise TypeError(f"a table cell must be a number, a string or None, not {type(value)!r}")


def _table(table: Table) -> dict[str, object]:
    rows = []
    for row in table.rows:
        if len(row) != len(table.columns):
            raise ValueError(
                f"table {table.title!r}: a row of {len(row)} cells for {len(table.columns)} "
                f"columns: {row!r}"
            )
        rows.append([_cell(v) for v in row])
    return {"title": table.title, "columns": [str(c) for c in table.columns], "rows": rows}


def _repo_path(arg: str) -> str:
    """`arg` relative to the repository when it names a path inside it, else as given."""
    path = Path(arg)
    if not (path.is_absolute() or path.exists()):
        return arg
    try:
        return path.resolve().relative_to(REPO).as_posix() or "."
    except (ValueError, OSError):
        return arg


def command_line(argv: list[str] | None = None) -> str:
    """The command as run (`sys.argv`), as one would type it at the repository's root: `python`,
    the script's path and the paths of its arguments relative to the repository."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return "python"
    args = []
    for arg in argv[1:]:
        name, eq, value = arg.partition("=")
        if eq and name.startswith("--"):
            args.append(f"{name}={_repo_path(value)}")
        else:
            args.append(_repo_path(arg))
    return shlex.join(["python", _repo_path(argv[0]), *args])


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def commit() -> str:
    """HEAD's short hash ("unknown" outside a git checkout)."""
    out = _git("rev-parse", "--short", "HEAD")
    return out.strip() if out else "unknown"


def dirty() -> bool:
    """Whether tracked files differ from HEAD (uncommitted changes), the results folder aside:
    a result written before is not a change to what was measured."""
    out = _git(
        "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results"
    )
    return bool(out and out.strip())


def cpu_description(cpuinfo: str | None = None) -> str:
    """The CPU as /proc/cpuinfo names it, with what decides the kernels' speed: e.g. "AMD EPYC
    (family 25 model 17; AVX-512 BF16, no AMX)" or "Intel Xeon Platinum 8488C (family 6 model
    143; AVX-512 BF16, AMX-BF16)". `cpuinfo`: the file's text (default: read it)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name")
    if not name:
        return platform.processor() or platform.machine() or "unknown CPU"
    name = " ".join(re.sub(r"\((R|r|TM|tm)\)", "", name).replace(" CPU ", " ").split())
    flags = set(fields.get("flags", "").split())
    if "avx512f" in flags:
        isa = "AVX-512 BF16" if "avx512_bf16" in flags else "AVX-512, no BF16"
    elif "avx2" in flags:
        isa = "AVX2, no AVX-512"
    else:
        isa = "no AVX2"
    amx = "AMX-BF16" if "amx_bf16" in flags else "no AMX"
    family, model = fields.get("cpu family"), fields.get("model")
    where = f"family {family} model {model}; " if family and model else ""
    return f"{name} ({where}{isa}, {amx})"


def default_threads() -> int:
    """torch's intra-op threads when the caller has imported torch, else the CPU count."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return int(torch.get_num_threads())
    return os.cpu_count() or 1


def _dumps(result: dict[str, object]) -> str:
    """`result` as indented JSON with each table row on one line (a row's change is a line's)."""

    def one(value: object) -> str:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)

    lines = ["{"]
    for i, (key, value) in enumerate(result.items()):
        end = "," if i < len(result) - 1 else ""
        if key != "tables":
            lines.append(f"  {one(key)}: {one(value)}{end}")
            continue
        lines.append('  "tables": [')
        tables: list[dict[str, object]] = value  # type: ignore[assignment]
        for j, table in enumerate(tables):
            rows: list[object] = table["rows"]  # type: ignore[assignment]
            lines += [
                "    {",
                f'      "title": {one(table["title"])},',
                f'      "columns": {one(table["columns"])},',
                '      "rows": [',
                *(
                    f"        {one(row)}{',' if k < len(rows) - 1 else ''}"
                    for k, row in enumerate(rows)
                ),
                "      ]",
                "    }" + ("," if j < len(tables) - 1 else ""),
            ]
        lines.append("  ]" + end)
    lines.append("}")
    text = "\n".join(lines) + "\n"
    assert json.loads(text) == result
    return text


def output_dir(given: Path | str | None = None) -> Path:
    """Where results go: `given`, else $THERMOSTAT_BENCH_RESULTS, else benchmarks/results."""
    if given is not None:
        return Path(given)
    return Path(os.environ.get(ENV_DIR) or DEFAULT_DIR)


def record(
    name: str,
    title: str,
    tables: list[Table],
    notes: str = "",
    results_dir: Path | str | None = None,
    threads: int | None = None,
) -> Path:
    """Write this run's result as `<results dir>/<name>.json` (replacing the last run's) and
    return its path. `threads`: the threads the measured engine ran on (default: torch's if
    imported, else the CPU count)."""
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"a result name is a plain file name, not {name!r}")
    result = {
        "benchmark": name,
        "title": title,
        "command": command_line(),
        "commit": commit(),
        "dirty": dirty(),
        "cpu": cpu_description(),
        "threads": int(default_threads() if threads is None else threads),
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "tables": [_table(t) for t in tables],
        "notes": notes,
    }
    folder = output_dir(results_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    text = _dumps(result)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(text)
    os.replace(partial, path)  # a reader never sees half a file
    print(f"result written to {_repo_path(str(path))}", file=sys.stderr)
    return path
