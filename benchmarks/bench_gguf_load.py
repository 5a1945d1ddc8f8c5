"""How soon a GGUF file is served and what its load costs in memory: llama-server and
`thermostat serve` started on the same file in turn, each measured from process start to a 200
from /health (ready), with the process's peak resident memory at that moment (VmHWM: the
weights as served, the pages of the file it still maps, the libraries). Thermostat's weights as
served come from its /get_server_info.

    python benchmarks/bench_gguf_load.py --thermostat .venv/bin/thermostat --gguf FILE [FILE ...]

llama-server comes from ../shared/peers/setup.sh (LLAMA_BIN_DIR, default
/tmp/peers/llama-build/bin). Prints a row per file and server (medians of `--reps` interleaved
starts) and records them (benchmarks/results.py: `benchmarks/results/bench_gguf_load.json`).

The recorded run's larger files are a random Llama of TinyLlama's shape (1.1B: 22 layers of
width 2048, MLP 5632, 32 heads, 4 KV heads; the peers' SmolLM2 tokenizer), written by
transformers in bf16, converted with the peers' converter and quantized by llama.cpp:

    PEERS_DIR=DIR python ../shared/peers/convert_gguf.py --models big --types f16
    llama-quantize DIR/gguf/big-f16.gguf big-Q4_K_M.gguf Q4_K_M   # and Q8_0
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_agreement import BIN_DIR, start, stop  # noqa: E402
from results import Table, record, show  # noqa: E402


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def measure(cmd: list[str], env: dict[str, str] | None, info: bool) -> tuple[float, float, float]:
    """(ready s, peak RSS MB at ready, weights as served MB or nan) of one cold start."""
    proc, url, ready = start(cmd, env)
    try:
        peak = peak_rss_mb(proc.pid)
        served = float("nan")
        if info:
            served = httpx.get(f"{url}/get_server_info", timeout=30).json()["weight_bytes"] / 2**20
    finally:
        stop([proc])
    return ready, peak, served


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", nargs="+", required=True, help="GGUF files both servers load")
    ap.add_argument("--thermostat", default=".venv/bin/thermostat")
    ap.add_argument("--reps", type=int, default=3, help="interleaved starts of each server")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    rows = []
    for path in a.gguf:
        servers = {
            "llama-server": (
                [os.path.join(BIN_DIR, "llama-server"), "-m", path, "-t", str(a.threads),
                 "--host", "127.0.0.1", "--port", "{PORT}", "--no-webui", "-c", "4096"],
                None,
            ),
            "thermostat": (
                [a.thermostat, "serve", "--model", path, "--port", "{PORT}"],
                dict(os.environ, OMP_NUM_THREADS=str(a.threads)),
            ),
        }  # fmt: skip
        runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in servers}
        for rep in range(a.reps):
            for name, (cmd, env) in servers.items():
                runs[name].append(measure(cmd, env, info=name == "thermostat"))
                ready, peak, _ = runs[name][-1]
                print(f"{Path(path).name} {name} start {rep + 1}: ready {ready:.2f} s, "
                      f"peak RSS {peak:.0f} MB", flush=True)  # fmt: skip
        file_mb = Path(path).stat().st_size / 2**20
        llama_ready = statistics.median(r[0] for r in runs["llama-server"])
        for name, measured in runs.items():
            ready = statistics.median(r[0] for r in measured)
            rows.append([
                Path(path).name, round(file_mb), name, round(ready, 2),
                round(min(r[0] for r in measured), 2), round(ready / llama_ready, 2),
                round(statistics.median(r[1] for r in measured)),
                round(measured[0][2]) if name == "thermostat" else None,
            ])  # fmt: skip
    table = Table(
        f"ready (process start to /health 200) and peak RSS at ready, medians of {a.reps} "
        f"interleaved starts, {a.threads} threads",
        ["file", "file MB", "server", "ready s", "fastest s", "ready / llama-server's",
         "peak RSS MB", "weights as served MB"],
        rows,
    )  # fmt: skip
    show(table)
    record("bench_gguf_load", "GGUF files: ready time and peak memory at load", [table])


if __name__ == "__main__":
    main()
