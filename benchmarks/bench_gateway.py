"""The gateway's overhead: TTFT and output tokens/s through `thermostat gateway` vs direct to the
same Thermostat upstream, at concurrency 1 and 32, in one interleaved run.

    .venv/bin/python benchmarks/bench_gateway.py [--model DIR] [--concurrency 1 32]
        [--repeats 2] [--output-tokens 64] [--json]

Without --model it serves a tiny random-weight model (tests' shape): the engine is then as fast
as it gets, so the gateway's share of each request is as large as it gets. Both servers and the
client run on this machine and share its cores: the figures include that contention. Every
load is `max(C, 8)` streamed completions (C at a time) of 16 random prompt token ids and
`--output-tokens` new tokens (`ignore_eos`, temperature 0.8 and top_p 0.95 sent in the body, so
both paths run the same sampling whatever the model's defaults, with a seed, `logprobs: 0` so
every token gets a chunk), each chunk parsed as a client would; one unmeasured load warms each
path first. TTFT is per request (sent -> first token's chunk), reported as the median; tokens/s
is the load's total over its wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http import serving  # noqa: E402
from results import Table as ResultTable  # noqa: E402
from results import record  # noqa: E402

console = Console(stderr=True)


async def stream_one(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[float, int]:
    """(TTFT in s, completion tokens) of one streamed completion."""
    start = time.perf_counter()
    ttft, tokens = float("nan"), 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if ttft != ttft and chunk.get("choices"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return ttft, tokens


async def load(url: str, concurrency: int, args: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)
    size = max(concurrency, 8)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(i: int) -> tuple[float, int]:
            body = {
                "prompt": [rng.randrange(10, 300) for _ in range(16)],
                "max_tokens": args.output_tokens,
                "temperature": 0.8,
                "top_p": 0.95,  # sent, so both paths sample alike whatever the model's defaults
                "seed": seed + i,
                "logprobs": 0,  # a chunk for every token, text or not (random models' tokens)
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with gate:
                return await stream_one(client, body)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(size)))
        elapsed = time.perf_counter() - start
    tokens = sum(t for _, t in results)
    if tokens != size * args.output_tokens:
        raise RuntimeError(f"{url}: {tokens} tokens, not {size} x {args.output_tokens}")
    return {"ttft_ms": 1000 * statistics.median(t for t, _ in results), "tok_s": tokens / elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="a Hugging Face model directory (default: tiny)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    python = [sys.executable, "-m", "thermostat.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from thermostat.random_model import write_model

            model = write_model(Path(tmp) / "tiny", "llama", generation_config={"top_p": 0.95})
        serve = [*python, "serve", "--model", str(model), "--port", "{PORT}",
                 "--max-num-seqs", "64", "--num-threads", "1"]  # fmt: skip
        with serving("upstream", serve, Path(tmp)) as upstream:
            gateway = [*python, "gateway", "--upstream", upstream, "--port", "{PORT}"]
            with serving("gateway", gateway, Path(tmp)) as through:
                paths = {"direct": upstream, "gateway": through}
                results: dict[tuple[str, int], list[dict]] = {}
                for c in args.concurrency:
                    for url in paths.values():
                        asyncio.run(load(url, c, args, seed=10_000 + c))  # warm-up
                for r in range(args.repeats):
                    for c in args.concurrency:
                        for name, url in paths.items():
                            console.log(f"repeat {r + 1}, c={c}, {name}")
                            results.setdefault((name, c), []).append(
                                asyncio.run(load(url, c, args, seed=c + r))
                            )
    med = {
        k: {m: statistics.median(x[m] for x in v) for m in ("ttft_ms", "tok_s")}
        for k, v in results.items()
    }
    columns = ["concurrency", "direct TTFT ms", "gateway TTFT ms", "direct tok/s",
               "gateway tok/s", "gateway/direct tok/s"]  # fmt: skip
    title = f"gateway overhead ({args.output_tokens} tokens/request, medians)"
    rows: list[list[str | float | int | None]] = []
    for c in args.concurrency:
        d, g = med[("direct", c)], med[("gateway", c)]
        rows.append([c, round(d["ttft_ms"], 1), round(g["ttft_ms"], 1), round(d["tok_s"]),
                     round(g["tok_s"]), round(g["tok_s"] / d["tok_s"], 2)])  # fmt: skip
    if args.json:
        print(json.dumps({f"{n}@c{c}": v for (n, c), v in med.items()}, indent=2))
    else:
        print_table(title, columns, med, args)
    record(
        "bench_gateway",
        "The gateway's overhead: TTFT and output tok/s through `thermostat gateway` vs direct",
        [ResultTable(title, columns, rows)],
        notes=f"Model: {'tiny random' if args.model is None else args.model.name}; "
        f"{args.repeats} interleaved repeats; servers and client share this machine's cores.",
        threads=1,
    )


def print_table(title: str, columns: list[str], med: dict, args: argparse.Namespace) -> None:
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    for c in args.concurrency:
        d, g = med[("direct", c)], med[("gateway", c)]
        table.add_row(str(c), f"{d['ttft_ms']:.1f}", f"{g['ttft_ms']:.1f}", f"{d['tok_s']:.0f}",
                      f"{g['tok_s']:.0f}", f"{g['tok_s'] / d['tok_s']:.2f}x")  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    main()
