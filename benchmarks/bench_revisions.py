"""Decode tok/s of two revisions of this repository, each in a process of its own, loads
alternating: did a change make the engine faster?

    .venv/bin/python benchmarks/bench_revisions.py BASE [HEAD] [--formats bf16 int8]
        [--batches 1 32] [--repeats 8] [--kv-cache-dtype fp8_e4m3]

BASE and HEAD are git revisions (HEAD defaults to the working tree, uncommitted changes
included); each is checked out in a temporary git work tree, imported by a child process of its
own (which builds or reuses its own CPU kernels) and serves the same random SmolLM2-135M-shaped
weights. Every repetition runs both, one after the other, in alternating order, on new prompts
(128 random tokens, 128 new tokens each, greedy); the table gives medians and the median of
the per-repetition ratios. Give the same revision twice to see the noise of the machine.
Loading two kernel builds into one process (the old one by path) is not a fair comparison: two
loads of the *same* build came out 15-30% apart that way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from results import Table as ResultTable
from results import record
from rich.console import Console
from rich.table import Table

console = Console(stderr=True)
REPO = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[4]]  # the revision's package, then this bench_http
import thermostat
from bench_http import prompts
from thermostat import LLM, SamplingParams
assert thermostat.__file__.startswith(sys.argv[1]), thermostat.__file__
model, formats, kv_cache_dtype = sys.argv[2], sys.argv[3].split(","), sys.argv[5]
llms = {f: LLM(model, dtype="bfloat16", num_threads=2, max_num_seqs=64,
               enable_prefix_caching=False, quantization=None if f == "bf16" else f,
               kv_cache_dtype=kv_cache_dtype)
        for f in formats}
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:  # "FORMAT BATCH SEED"
    fmt, batch, seed = line.split()
    engine = llms[fmt].engine
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    batch_prompts = prompts(int(batch), 128, 49152, int(seed))
    engine.add_group(f"bench-{seed}", engine.plan(batch_prompts, params))
    start, produced = time.perf_counter(), 0
    while engine.has_unfinished():
        produced += sum(len(out.new_token_ids) for out in engine.step())
    print(json.dumps({"tok_s": produced / (time.perf_counter() - start)}), flush=True)
"""


def work_tree(stack: ExitStack, revision: str | None, tmp: Path, name: str) -> Path:
    """The repository at `revision` (None: this checkout as it is) in a work tree of its own."""
    if revision is None:
        return REPO
    path = tmp / name
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(path),
                    revision], check=True)  # fmt: skip
    stack.callback(subprocess.run, ["git", "-C", str(REPO), "worktree", "remove", "--force",
                                    str(path)], check=False)  # fmt: skip
    return path


def short_hash(revision: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", revision],
                          capture_output=True, text=True)  # fmt: skip
    return done.stdout.strip() or "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("base", help="a git revision")
    p.add_argument("head", nargs="?", help="a git revision (default: the working tree)")
    p.add_argument("--formats", nargs="+", default=["bf16"], choices=["bf16", "int8", "int4"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    args = p.parse_args()
    import torch

    from thermostat.random_model import SMOLLM2_135M, write_model

    runs: dict[tuple[str, str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        model = write_model(Path(tmp) / "model", "llama", dtype=torch.bfloat16, **SMOLLM2_135M)
        sides = {"base": work_tree(stack, args.base, Path(tmp), "base"),
                 "head": work_tree(stack, args.head, Path(tmp), "head")}  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="2")
        children = {}
        for side, tree in sides.items():
            command = [sys.executable, "-c", CHILD, str(tree), str(model), ",".join(args.formats),
                       str(REPO / "benchmarks"), args.kv_cache_dtype]  # fmt: skip
            child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=tmp)  # fmt: skip
            stack.callback(child.kill)
            children[side] = child
        for side, child in children.items():
            assert child.stdin and child.stdout
            if not child.stdout.readline():
                raise RuntimeError(f"the {side} engine ({sides[side]}) did not start")
        for repeat in range(args.repeats):
            for fmt in args.formats:
                for batch in args.batches:
                    order = list(children) if repeat % 2 == 0 else list(children)[::-1]
                    for side in order:
                        child = children[side]
                        assert child.stdin and child.stdout
                        child.stdin.write(f"{fmt} {batch} {repeat + 1}\n")
                        child.stdin.flush()
                        tok_s = json.loads(child.stdout.readline())["tok_s"]
                        runs.setdefault((side, fmt, batch), []).append(tok_s)
                    ratio = runs[("head", fmt, batch)][-1] / runs[("base", fmt, batch)][-1]
                    console.print(f"repeat {repeat} {fmt} batch {batch}: head / base {ratio:.3f}")
    kv = "" if args.kv_cache_dtype == "auto" else f", KV cache {args.kv_cache_dtype}"
    table = Table(title=f"decode tok/s, {args.base} vs {args.head or 'working tree'}{kv}, "
                  f"{args.repeats} alternating repetitions")  # fmt: skip
    for column in ("format", "batch", "base", "head", "head / base", "per repetition"):
        table.add_column(column, justify="left" if column == "per repetition" else "right")
    columns = ["format", "batch", "base tok/s", "head tok/s", "head / base", "per repetition"]
    recorded = ResultTable(table.title or "", columns, [])
    for fmt in args.formats:
        for batch in args.batches:
            base, head = runs[("base", fmt, batch)], runs[("head", fmt, batch)]
            ratios = [h / b for b, h in zip(base, head, strict=True)]
            table.add_row(fmt, str(batch), f"{statistics.median(base):.1f}",
                          f"{statistics.median(head):.1f}", f"{statistics.median(ratios):.3f}",
                          " ".join(f"{r:.2f}" for r in ratios))  # fmt: skip
            recorded.rows.append([fmt, batch, round(statistics.median(base), 1),
                                  round(statistics.median(head), 1),
                                  round(statistics.median(ratios), 3),
                                  " ".join(f"{r:.2f}" for r in ratios)])  # fmt: skip
    console.print(table)
    record(
        "bench_revisions",
        "Decode tok/s of two revisions, each in a process of its own, loads alternating",
        [recorded],
        notes=f"base: {args.base} = {short_hash(args.base)}; head: "
        + (f"{args.head} = {short_hash(args.head)}" if args.head else "the working tree")
        + ".",
        threads=2,
    )


if __name__ == "__main__":
    main()
