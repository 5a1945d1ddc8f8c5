"""What an open console costs the server: output tokens/s over HTTP with the console closed and
with it open and refreshing, in one interleaved run on one server.

    .venv/bin/python benchmarks/bench_console.py [--model DIR] [--concurrency 1 32] [--repeats 3]
        [--viewer browser|poll]

The load is bench_http.py's (128 random prompt tokens, 128 new tokens per request, streamed and
parsed; max(C, 4) requests C at a time; a warm-up load first). "open" means a headless Chromium
tab on /console for the whole load (`--viewer browser`: it polls /v1/console/state every 2 s and
redraws its plots and table, on this same machine), or a plain client polling that route every
2 s (`--viewer poll`: the server's share of the cost alone). Each repeat measures closed and
open in turn, alternating which goes first; the table gives medians and open/closed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from bench_http import http_load, random_model, serving  # noqa: E402
from results import Table as ResultTable  # noqa: E402
from results import record  # noqa: E402

from tools.chromium import launch  # noqa: E402

console = Console(stderr=True)


@contextmanager
def viewer(url: str, kind: str) -> Iterator[None]:
    """The console open on `url` until the block ends, from a thread of its own (Playwright's
    sync API holds an event loop; the load runs its own)."""
    stop, opened = threading.Event(), threading.Event()

    def poll() -> None:
        after = 0
        with httpx.Client(base_url=url, timeout=30) as client:
            opened.set()
            while not stop.wait(2.0):
                rows = client.get(f"/v1/console/state?after={after}").json()["requests"]
                after = rows[-1]["id"] if rows else after

    def browse() -> None:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = launch(p)
            page = browser.new_page(viewport={"width": 1400, "height": 1600})
            page.goto(url + "/console")
            page.wait_for_selector("#defaults-table tbody tr", timeout=60_000)
            opened.set()
            stop.wait()
            browser.close()

    thread = threading.Thread(target=poll if kind == "poll" else browse, daemon=True)
    thread.start()
    if not opened.wait(120):
        raise RuntimeError("the console did not open")
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="a Hugging Face model directory (default: random)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--viewer", choices=["browser", "poll"], default="browser")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    args = p.parse_args()
    top = max(args.concurrency)
    runs: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or random_model(Path(tmp))
        vocab = int(__import__("json").loads((model / "config.json").read_text())["vocab_size"])
        command = [
            sys.executable, "-m", "thermostat.cli", "serve", "--model", str(model),
            "--port", "{PORT}", "--served-model-name", "model", "--num-threads", "2",
            "--max-num-seqs", str(top), "--no-enable-prefix-caching",
        ]  # fmt: skip
        with serving("thermostat", command, Path(tmp)) as url:
            for c in args.concurrency:
                http_load(url, c, vocab, args, seed=c + 1000)  # warm-up, same shape
            for repeat in range(args.repeats):
                for c in args.concurrency:
                    order = ["closed", "open"] if repeat % 2 == 0 else ["open", "closed"]
                    for state in order:
                        if state == "open":
                            with viewer(url, args.viewer):
                                tok_s = http_load(url, c, vocab, args)
                        else:
                            tok_s = http_load(url, c, vocab, args)
                        runs.setdefault((state, c), []).append(tok_s)
                        console.print(f"repeat {repeat} c={c} console {state}: {tok_s:.1f} tok/s")
    medians = {key: statistics.median(values) for key, values in runs.items()}
    table = Table(title=f"output tok/s, console closed vs open ({args.viewer}), medians")
    recorded = ResultTable(
        table.title or "", ["console", *(f"c={c}" for c in args.concurrency)], []
    )
    table.add_column("console")
    for c in args.concurrency:
        table.add_column(f"c={c}", justify="right")
    for state in ("closed", "open"):
        table.add_row(state, *(f"{medians[(state, c)]:.1f}" for c in args.concurrency))
        recorded.rows.append([state, *(round(medians[(state, c)], 1) for c in args.concurrency)])
    ratios = [medians[("open", c)] / medians[("closed", c)] for c in args.concurrency]
    table.add_row("open / closed", *(f"{r:.3f}x" for r in ratios))
    recorded.rows.append(["open / closed", *(round(r, 3) for r in ratios)])
    Console().print(table)
    viewer_note = {
        "browser": "Open: a headless Chromium tab on /console, on this same machine",
        "poll": "Open: a client polling /v1/console/state every 2 s (the server's share alone)",
    }
    record(
        "bench_console",
        "What an open console costs the server: output tok/s over HTTP, console closed vs open",
        [recorded],
        notes=f"{viewer_note[args.viewer]}; medians of {args.repeats} interleaved repeats.",
        threads=2,
    )


if __name__ == "__main__":
    main()
