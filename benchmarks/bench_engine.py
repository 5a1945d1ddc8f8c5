"""Output tokens/s and time to first token: Thermostat vs transformers `generate`, same random
weights shaped like SmolLM2-135M, same dtype, in one run.

    .venv/bin/python benchmarks/bench_engine.py [--batches 1 8 32] [--dtype bfloat16] [--json]
    .venv/bin/python benchmarks/bench_engine.py --formats bf16 int8 int4   # weight formats

Each batch size submits N requests of 128 random prompt tokens at once and generates 128 new
tokens each (no early stop). The two engines run alternately `--repeats` times (default 3) and
the table reports medians, with the ratio as the median of the back-to-back pairs: on a shared
2-core machine a single pair can be off by 20% either way. Also measures the machine's copy
bandwidth and how close batch-1 decode gets to the bandwidth bound (weight bytes per token /
bandwidth).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from results import Table as ResultTable
from results import record
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from thermostat import LLM, SamplingParams, kernels
from thermostat.random_model import SMOLLM2_135M, write_model

console = Console(stderr=True)


def copy_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Best of `repeats` copies: bytes read + bytes written per second."""
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best / 1e9


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (batch, length), generator=gen).tolist()


def medians(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def run_thermostat(llm: LLM, batch: int, args, seed: int = 1) -> dict:
    """`seed` picks the prompts: a new one per repeat, so no run hits the prefix cache."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    batch_prompts = prompts(batch, args.prompt_tokens, 49152, seed)
    ids = [
        item.req_id
        for item in engine.add_group(f"bench-{seed}", engine.plan(batch_prompts, params))
    ]
    start = time.perf_counter()
    first: dict[str, float] = {}
    produced = 0
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.req_id, time.perf_counter() - start)
            produced += len(out.new_token_ids)
    elapsed = time.perf_counter() - start
    assert produced == batch * args.output_tokens and len(first) == len(ids)
    return {"tok_s": produced / elapsed, "ttft_s": sum(first.values()) / len(first)}


@torch.inference_mode()
def run_transformers(model, batch: int, args, seed: int = 1) -> dict:
    ids = torch.tensor(prompts(batch, args.prompt_tokens, 49152, seed))
    mask = torch.ones_like(ids)
    common = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **common)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    out = model.generate(
        ids, max_new_tokens=args.output_tokens, min_new_tokens=args.output_tokens, **common
    )
    elapsed = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * batch
    return {"tok_s": produced / elapsed, "ttft_s": ttft}


def compare_formats(model_dir: Path, args, bandwidth: float) -> None:
    """Thermostat in each weight format on the same model, alternating, medians."""
    llms = {}
    for fmt in args.formats:
        llms[fmt] = LLM(
            str(model_dir),
            dtype=args.dtype,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            quantization=None if fmt == "bf16" else fmt,
        )
        run_thermostat(llms[fmt], 2, argparse.Namespace(prompt_tokens=16, output_tokens=4), 0)
    table = Table(
        title=f"SmolLM2-135M-shaped weight formats, {torch.get_num_threads()} threads, medians "
        f"of {args.repeats} alternating runs, CPU kernels {kernels.status()}"
    )
    table.add_column("batch", justify="right")
    for fmt in args.formats:
        mb = llms[fmt].engine.loaded.weight_bytes / 1e6
        table.add_column(f"{fmt} tok/s ({mb:.0f} MB)", justify="right")
    first = args.formats[0]
    for fmt in args.formats[1:]:
        table.add_column(f"{fmt} / {first}", justify="right")
    recorded = ResultTable(table.title or "", [str(c.header) for c in table.columns], [])
    results = []
    for batch in args.batches:
        runs: dict[str, list[float]] = {fmt: [] for fmt in args.formats}
        for rep in range(args.repeats):
            for fmt, llm in llms.items():
                console.log(f"batch {batch}, run {rep + 1}/{args.repeats}: {fmt}")
                runs[fmt].append(run_thermostat(llm, batch, args, seed=1 + rep)["tok_s"])
        med = {fmt: statistics.median(v) for fmt, v in runs.items()}
        ratios = [
            statistics.median(a / b for a, b in zip(runs[fmt], runs[first], strict=True))
            for fmt in args.formats[1:]
        ]
        results.append({"batch": batch, "tok_s": med, "runs": runs})
        table.add_row(
            str(batch), *(f"{med[f]:.1f}" for f in args.formats), *(f"{r:.2f}x" for r in ratios)
        )
        recorded.rows.append(
            [batch, *(round(med[f], 1) for f in args.formats), *(round(r, 2) for r in ratios)]
        )
    if args.json:
        print(json.dumps({"copy_bandwidth_gbs": bandwidth, "rows": results}, indent=2))
    else:
        Console().print(table)
        print(f"copy bandwidth {bandwidth:.1f} GB/s")
    record(
        "bench_engine_formats",
        "Thermostat's weight formats offline, SmolLM2-135M-shaped random weights",
        [recorded],
        notes=f"copy bandwidth {bandwidth:.1f} GB/s",
    )


def record_engine(rows: list[dict], args, kernel_state: str, note: str) -> None:
    """The Thermostat vs transformers table as a result: medians, the ratio (the median of the
    back-to-back pairs) and its range, TTFT of both."""
    cells = []
    for row in rows:
        ours, ref = row["thermostat"], row["transformers"]
        cells.append(
            [
                row["batch"],
                round(ours["tok_s"], 1),
                round(ref["tok_s"], 1) if ref else None,
                round(row["ratio"], 2) if ref else None,
                round(min(row["ratios"]), 2) if ref else None,
                round(max(row["ratios"]), 2) if ref else None,
                round(ours["ttft_s"], 2),
                round(ref["ttft_s"], 2) if ref else None,
            ]
        )
    columns = ["batch", "thermostat tok/s", "transformers tok/s", "ratio", "ratio min",
               "ratio max", "TTFT ours (s)", "TTFT hf (s)"]  # fmt: skip
    title = (
        f"SmolLM2-135M-shaped, {args.dtype}, {torch.get_num_threads()} threads, medians of "
        f"{args.repeats} alternating runs, CPU kernels {kernel_state}"
    )
    record(
        "bench_engine",
        "Output tok/s and TTFT offline: Thermostat vs transformers generate, same random weights",
        [ResultTable(title, columns, cells)],
        notes=note,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a written model")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--no-kernels", action="store_true", help="the pure-PyTorch path")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per batch size")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--formats",
        nargs="+",
        choices=["bf16", "int8", "int4"],
        help="compare Thermostat's weight formats (alternating, ratios to the first) instead "
        "of transformers",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    dtype = getattr(torch, args.dtype)
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="thermostat-bench-"))
    if not (model_dir / "config.json").is_file():
        console.log(f"writing a random SmolLM2-135M-shaped model to {model_dir}")
        write_model(model_dir, "llama", dtype=dtype, **SMOLLM2_135M)
    bandwidth = copy_bandwidth_gbs()
    if args.formats:
        compare_formats(model_dir, args, bandwidth)
        return
    llm = LLM(
        str(model_dir),
        dtype=args.dtype,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        cpu_kernels=not args.no_kernels,
    )
    kernel_state = "off (--no-kernels)" if args.no_kernels else kernels.status()
    # bytes a decode step must read: every weight once (the tied embedding as the LM head)
    weight_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    run_thermostat(llm, 2, argparse.Namespace(prompt_tokens=16, output_tokens=4), seed=0)  # warm-up
    hf = None
    if not args.skip_transformers:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        run_transformers(hf, 1, argparse.Namespace(prompt_tokens=16, output_tokens=4))

    rows = []
    for batch in args.batches:
        ours_runs, ref_runs = [], []
        for rep in range(args.repeats):
            console.log(f"batch {batch}, run {rep + 1}/{args.repeats}: thermostat")
            ours_runs.append(run_thermostat(llm, batch, args, seed=1 + rep))
            if hf is not None:
                console.log(f"batch {batch}, run {rep + 1}/{args.repeats}: transformers")
                ref_runs.append(run_transformers(hf, batch, args, seed=1 + rep))
        row = {"batch": batch, "thermostat": medians(ours_runs), "runs": ours_runs}
        row["transformers"] = medians(ref_runs) if ref_runs else None
        if ref_runs:
            row["transformers_runs"] = ref_runs
            pairs = [o["tok_s"] / r["tok_s"] for o, r in zip(ours_runs, ref_runs, strict=True)]
            row["ratio"] = statistics.median(pairs)
            row["ratios"] = pairs
        rows.append(row)

    bound = bandwidth * 1e9 / weight_bytes
    result = {
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "cpu_kernels": kernel_state,
        "copy_bandwidth_gbs": bandwidth,
        "weight_bytes": weight_bytes,
        "bandwidth_bound_tok_s": bound,
        "rows": rows,
    }
    batch1 = next((r["thermostat"]["tok_s"] for r in rows if r["batch"] == 1), None)
    bandwidth_note = (
        f"copy bandwidth {bandwidth:.1f} GB/s; weights {weight_bytes / 1e6:.0f} MB -> "
        f"bound {bound:.1f} tok/s at batch 1"
        + (f"; batch-1 decode reaches {batch1 / bound:.0%} of it" if batch1 else "")
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(rows, args, kernel_state)
        print(bandwidth_note)
    record_engine(rows, args, kernel_state, bandwidth_note)


def print_table(rows: list[dict], args, kernel_state: str) -> None:
    table = Table(
        title=f"SmolLM2-135M-shaped, {args.dtype}, {torch.get_num_threads()} threads, "
        f"medians of {args.repeats} alternating runs, "
        f"CPU kernels {kernel_state}"
    )
    for col in (
        "batch",
        "thermostat tok/s",
        "transformers tok/s",
        "ratio (range)",
        "TTFT ours / hf (s)",
    ):
        table.add_column(col, justify="right")
    for row in rows:
        ours, ref = row["thermostat"], row["transformers"]
        table.add_row(
            str(row["batch"]),
            f"{ours['tok_s']:.1f}",
            f"{ref['tok_s']:.1f}" if ref else "-",
            f"{row['ratio']:.2f}x ({min(row['ratios']):.2f}-{max(row['ratios']):.2f})"
            if ref
            else "-",
            f"{ours['ttft_s']:.2f} / {ref['ttft_s']:.2f}" if ref else f"{ours['ttft_s']:.2f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
