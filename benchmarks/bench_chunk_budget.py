"""The step's token budget (`--max-num-batched-tokens`, chunked prefill) against prefill speed.

    .venv/bin/python benchmarks/bench_chunk_budget.py [--budgets 256 512 1024 2048 4096]
        [--lens 2048 8192] [--repeats 2]

A long prompt is prefilled in chunks of at most the budget; a larger chunk runs its linear layers
on more rows at once, a smaller one lets the decoding requests beside it step sooner (a decode
step that carries a chunk takes about the chunk's time). Offline, in one process: one engine per
budget on the SmolLM2-135M shape with random weights (bench_http.py's), written with a context of
the longest length, no prefix cache. Each repeat prefills one fresh prompt of each length on
every engine in turn, so a noisy neighbour slows them all alike. Reported: prefill tok/s (the
best of the repeats) and the chunk's time at the longest length, budget / rate: what a decoding
neighbour waits per step while the prompt prefills.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from bench_http import random_model
from results import Table, record, show
from rich.console import Console

from thermostat import LLM, SamplingParams

console = Console(stderr=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--lens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kv-cache-dtype", default="auto")
    args = p.parse_args()
    torch.set_num_threads(2)
    max_len = max(args.lens) + 64
    with tempfile.TemporaryDirectory() as tmp:
        model = random_model(Path(tmp), max_position_embeddings=max_len)
        engines = {
            b: LLM(
                str(model),
                max_num_batched_tokens=b,
                enable_prefix_caching=False,
                max_model_len=max_len,
                kv_cache_dtype=args.kv_cache_dtype,
                kv_cache_memory_gb=0.5,
            )  # fmt: skip
            for b in args.budgets
        }
        first = SamplingParams(temperature=0.0, max_tokens=1)
        for llm in engines.values():
            llm.generate([list(range(1, 129))], first)  # warm-up
        best = {(b, n): float("inf") for b in args.budgets for n in args.lens}
        g = torch.Generator().manual_seed(0)
        for repeat in range(args.repeats):
            for n in args.lens:
                ids = torch.randint(1, 49152, (n,), generator=g).tolist()
                for b, llm in engines.items():
                    start = time.perf_counter()
                    llm.generate([ids], first)
                    elapsed = time.perf_counter() - start
                    best[b, n] = min(best[b, n], elapsed)
                    console.print(f"repeat {repeat}: budget {b:>5}, {n:>6} tokens: {elapsed:.2f} s")
    longest = max(args.lens)
    columns = ["budget", *(f"{n} tok/s" for n in args.lens), f"chunk at {longest}, ms"]
    rows: list[list[str | float | None]] = []
    for b in args.budgets:
        rates = [round(n / best[b, n]) for n in args.lens]
        rows.append([b, *rates, round(min(b, longest) / (longest / best[b, longest]) * 1000)])
    table = Table(f"prefill tok/s by --max-num-batched-tokens, best of {args.repeats}", columns,
                  rows)  # fmt: skip
    show(table)
    record(
        "bench_chunk_budget",
        "The step's token budget (chunked prefill) against prefill speed",
        [table],
        notes="Offline, one engine per budget in one process, prompts interleaved across them; "
        f"KV cache {args.kv_cache_dtype}. The chunk's time (budget / rate at the longest length) "
        "is what a decoding request beside the prompt waits per step.",
        threads=2,
    )


if __name__ == "__main__":
    main()
