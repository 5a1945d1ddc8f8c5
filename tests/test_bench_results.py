"""benchmarks/results.py: a benchmark's result as JSON (the latest run, with the command, commit,
CPU, threads and date), and one real benchmark writing it end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"

_spec = importlib.util.spec_from_file_location("bench_results", BENCHMARKS / "results.py")
assert _spec is not None and _spec.loader is not None
results = importlib.util.module_from_spec(_spec)
sys.modules["bench_results"] = results  # dataclasses look their module up
_spec.loader.exec_module(results)

KEYS = ["benchmark", "title", "command", "commit", "dirty", "cpu", "threads", "date", "tables",
        "notes"]  # fmt: skip
DATE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def check_schema(result: dict, name: str) -> None:
    assert list(result) == KEYS
    assert result["benchmark"] == name
    assert isinstance(result["title"], str) and result["title"]
    assert result["command"].startswith("python benchmarks/")
    # HEAD's short hash when it ran (HEAD may have moved on since: others commit meanwhile)
    assert re.fullmatch(r"[0-9a-f]{7,40}", result["commit"]), result["commit"]
    assert git("rev-parse", "--short", result["commit"]) == result["commit"]
    ancestor = ["git", "-C", str(REPO), "merge-base", "--is-ancestor", result["commit"], "HEAD"]
    assert subprocess.run(ancestor).returncode == 0
    assert isinstance(result["dirty"], bool)
    assert isinstance(result["cpu"], str) and result["cpu"]
    assert isinstance(result["threads"], int) and result["threads"] >= 1
    assert DATE.fullmatch(result["date"]), result["date"]
    assert isinstance(result["notes"], str)
    assert result["tables"]
    for table in result["tables"]:
        assert list(table) == ["title", "columns", "rows"]
        assert all(isinstance(c, str) for c in table["columns"])
        for row in table["rows"]:
            assert len(row) == len(table["columns"])
            assert all(v is None or isinstance(v, str | int | float) for v in row)


def test_record_writes_the_schema(tmp_path, monkeypatch):
    monkeypatch.setattr(
        sys,
        "argv",
        [str(BENCHMARKS / "bench_x.py"), "--model", str(REPO / "thermostat"), "-n", "2"],
    )
    tables = [
        results.Table("tok/s", ["batch", "tok/s", "ratio"], [[1, 12.5, None], [32, 301.0, 1.02]]),
        results.Table("notes", ["what", "value"], [["nan", float("nan")]]),
    ]
    path = results.record("bench_x", "A benchmark", tables, notes="one caveat",
                          results_dir=tmp_path, threads=2)  # fmt: skip
    assert path == tmp_path / "bench_x.json"
    result = json.loads(path.read_text())
    check_schema(result, "bench_x")
    # the script and the paths inside the repository relative to its root, as typed there
    assert result["command"] == "python benchmarks/bench_x.py --model thermostat -n 2"
    assert result["threads"] == 2
    assert result["notes"] == "one caveat"
    assert result["tables"][0] == {
        "title": "tok/s",
        "columns": ["batch", "tok/s", "ratio"],
        "rows": [[1, 12.5, None], [32, 301.0, 1.02]],
    }
    assert result["tables"][1]["rows"] == [["nan", None]]  # JSON has no NaN

    # the latest run replaces the last; the environment picks the folder when no argument does
    monkeypatch.setenv("THERMOSTAT_BENCH_RESULTS", str(tmp_path / "env"))
    again = results.record("bench_x", "Again", tables[:1])
    assert again == tmp_path / "env" / "bench_x.json"
    assert json.loads(again.read_text())["title"] == "Again"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_x.json", "env"]


def test_record_refuses_bad_tables(tmp_path):
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        results.record(
            "x", "x", [results.Table("t", ["a", "b", "c"], [[1, 2]])], results_dir=tmp_path
        )
    with pytest.raises(TypeError):
        results.record("x", "x", [results.Table("t", ["a"], [[[1]]])], results_dir=tmp_path)
    with pytest.raises(ValueError, match="plain file name"):
        results.record("../x", "x", [], results_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_cpu_description():
    intel = (
        "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
        "model name\t: Intel(R) Xeon(R) Platinum 8488C\n"
        "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n\nprocessor\t: 1\n"
    )
    assert results.cpu_description(intel) == (
        "Intel Xeon Platinum 8488C (family 6 model 143; AVX-512 BF16, AMX-BF16)"
    )
    amd = "cpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\nflags\t\t: avx2 avx512f\n"
    assert results.cpu_description(amd) == "AMD EPYC (family 25 model 17; AVX-512, no BF16, no AMX)"
    assert results.cpu_description("model name : Some CPU\nflags : sse2\n") == (
        "Some CPU (no AVX2, no AMX)"
    )
    assert results.cpu_description()  # this machine's, whatever it is


def test_a_benchmark_records_its_table(tmp_path):
    """bench_structured.py on the demo model, as small as it goes, into a temporary folder."""
    env = dict(os.environ, THERMOSTAT_BENCH_RESULTS=str(tmp_path), OMP_NUM_THREADS="2")
    argv = ["--batches", "1", "--tokens", "8", "--repeats", "1"]
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_structured.py", *argv],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "| batch | unconstrained tok/s |" in done.stdout  # still printed
    result = json.loads((tmp_path / "bench_structured.json").read_text())
    check_schema(result, "bench_structured")
    assert result["command"] == "python benchmarks/bench_structured.py " + " ".join(argv)
    (table,) = result["tables"]
    assert table["columns"][0] == "batch"
    (row,) = table["rows"]
    assert row[0] == 1
    assert all(isinstance(v, float) and v > 0 for v in row[1:])
