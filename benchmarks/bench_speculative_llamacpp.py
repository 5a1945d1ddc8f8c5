"""Prompt-lookup speculation side by side with llama.cpp's: `thermostat serve --speculative ngram`
against `llama-server --spec-type ngram-simple` on the same weights, over HTTP, one request at a
time, each server with speculation off and on, interleaved (every server serves each workload in
turn; medians of `--repeats`).

    PEERS_DIR=/tmp/peers .venv/bin/python benchmarks/bench_speculative_llamacpp.py [--repeats 3]

Needs `../shared/peers/setup.sh` (llama-server) and a GGUF of the demo model:
`$PEERS_DIR/gguf/demo-f16.gguf` (`../shared/peers/convert_gguf.py --models demo --types f16`
with `$PEERS_DIR/models/demo-fp32` linked to `thermostat/models/demo`). Both servers run the same
f16/bf16 weights of the demo model (or `--model DIR --gguf FILE`, e.g. the peers' `small`) on 2
threads, 96 new tokens; llama-server drafts up to 4 tokens from a 3-gram
(`--spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 4`), Thermostat proposes up to 4 from
a 3-, 2- or 1-gram.

Workloads: copy (a passage given twice and the start of a third copy), the demo's greedy loops
from an opening, and prose that does not repeat (temperature 1.0, seeded, from an opening).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from thermostat.engine.loader import DEMO_MODEL_DIR

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http import serving  # noqa: E402
from results import Table as ResultTable  # noqa: E402
from results import record  # noqa: E402

console = Console(stderr=True)
PEERS_DIR = Path(os.environ.get("PEERS_DIR", "/tmp/peers"))
PASSAGE = (
    "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n"
    "And all the clouds that lour'd upon our house\nIn the deep bosom of the ocean buried.\n"
)
WORKLOADS = {  # name: (prompt, temperature)
    "copy (greedy)": (PASSAGE * 2 + PASSAGE[:40], 0.0),
    "loops (greedy)": ("The king", 0.0),
    "prose (temperature 1.0)": ("My lord,", 1.0),
}
NEW_TOKENS = 96


@dataclass
class Server:
    name: str
    command: list[str]
    rates: dict[str, list[float]] = field(default_factory=dict)


def tok_s(url: str, prompt: str, temperature: float) -> float:
    """Output tokens per second of one non-streamed completion (prefill included: both servers
    cache the prompt after the first request)."""
    body = {
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": temperature,
        "seed": 0,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"] / elapsed


def servers(thermostat: str, model: Path, gguf: Path) -> list[Server]:
    llama = [
        str(PEERS_DIR / "llama-build" / "bin" / "llama-server"),
        "-m", str(gguf), "-t", "2", "-tb", "2", "-c", "4096", "-np", "1",
        "--host", "127.0.0.1", "--port", "{PORT}", "--no-webui",
    ]  # fmt: skip
    ngram = [
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
        "--spec-ngram-simple-size-m", "4",
    ]  # fmt: skip
    ours = [
        thermostat, "serve", "--model", str(model), "--port", "{PORT}",
        "--num-threads", "2", "--max-num-seqs", "4",
    ]  # fmt: skip
    return [
        Server("llama-server f16", llama),
        Server("llama-server f16 ngram", llama + ngram),
        Server("thermostat bf16", ours),
        Server("thermostat bf16 ngram", ours + ["--speculative", "ngram"]),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--thermostat", default=str(Path(sys.executable).parent / "thermostat"))
    p.add_argument("--model", type=Path, default=DEMO_MODEL_DIR, help="Thermostat's checkpoint")
    p.add_argument("--gguf", type=Path, default=PEERS_DIR / "gguf" / "demo-f16.gguf")
    args = p.parse_args()
    if not args.gguf.exists():
        sys.exit(f"{args.gguf} is missing: see this script's docstring")
    results = PEERS_DIR / "results"
    results.mkdir(parents=True, exist_ok=True)
    fleet = servers(args.thermostat, args.model, args.gguf)
    for repeat in range(args.repeats):  # each server alone on the 2 cores, in turn
        for server in fleet if repeat % 2 == 0 else fleet[::-1]:
            log_name = "spec-" + server.name.replace(" ", "-")
            with serving(log_name, server.command, results) as url:
                for name, (prompt, temperature) in WORKLOADS.items():
                    tok_s(url, prompt, temperature)  # warm-up; the prompt cached
                    rate = tok_s(url, prompt, temperature)
                    server.rates.setdefault(name, []).append(rate)
                    console.log(f"{repeat} {server.name:<24} {name:<24} {rate:6.1f} tok/s")
    table = Table(title=f"output tok/s at one request, medians ({args.model.name}, 2 threads)")
    table.add_column("workload")
    for server in fleet:
        table.add_column(server.name, justify="right")
    table.add_column("llama on/off", justify="right")
    table.add_column("thermostat on/off", justify="right")
    table.add_column("thermostat/llama, on", justify="right")
    recorded = ResultTable(table.title or "", [str(c.header) for c in table.columns], [])
    for name in WORKLOADS:
        llama_off, llama_on, ours_off, ours_on = (statistics.median(s.rates[name]) for s in fleet)
        table.add_row(
            name,
            *(f"{statistics.median(s.rates[name]):.1f}" for s in fleet),
            f"{llama_on / llama_off:.2f}x",
            f"{ours_on / ours_off:.2f}x",
            f"{ours_on / llama_on:.2f}x",
        )
        recorded.rows.append(
            [
                name,
                *(round(statistics.median(s.rates[name]), 1) for s in fleet),
                round(llama_on / llama_off, 2),
                round(ours_on / ours_off, 2),
                round(ours_on / llama_on, 2),
            ]
        )
    Console(width=160).print(table)
    record(
        "bench_speculative_llamacpp",
        "Prompt-lookup speculation beside llama.cpp's: thermostat serve --speculative ngram vs "
        "llama-server --spec-type ngram-simple, same weights",
        [recorded],
        notes=f"Medians of {args.repeats} interleaved repeats, {NEW_TOKENS} new tokens, one "
        "request at a time.",
        threads=2,
    )


if __name__ == "__main__":
    main()
