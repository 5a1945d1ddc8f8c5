"""What prompt-lookup speculation (`--speculative ngram`) costs and saves, one interleaved run
(speculation off and on take turns; medians of `--repeats`).

    .venv/bin/python benchmarks/bench_speculative.py [--repeats 3]

1. The cost of a verification step: a decode step whose requests each check k proposals
   (k = 2, 4, 8; the proposals are forced and the model's own tokens, so every row is computed)
   relative to a plain decode step, at batch 1 and 8, on the SmolLM2-135M shape (random weights,
   bfloat16) and on the demo model.
2. End-to-end output tok/s, off vs on:
   - copy: the demo model given a passage twice and the start of a third copy (a client that
     pastes a file and has it written back with changes is the same shape): batch 1, greedy and
     sampled (temperature 0.7);
   - loops: the demo model's greedy loops (the case), batch 1;
   - the SmolLM2-135M shape's greedy text (random weights: it falls into loops too), batch 1;
   - proposals that never hold (each one a token the model does not pick: the worst case of
     text that does not repeat, until the request stops proposing), batch 1;
   - sampled prose: the demo model at temperature 1.0 from an opening (its text seldom repeats);
   - batch 32: the demo model, 32 different openings (above 4 running nothing is proposed).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from results import Table as ResultTable
from results import record
from rich.console import Console
from rich.table import Table

from thermostat import LLM, SamplingParams
from thermostat.engine import scheduler as scheduler_module
from thermostat.random_model import SMOLLM2_135M, write_model

console = Console(stderr=True)
PASSAGE = (
    "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n"
    "And all the clouds that lour'd upon our house\nIn the deep bosom of the ocean buried.\n"
)
OPENINGS = [
    "The king", "Enter HAMLET", "My lord,", "What say you", "First Citizen:", "O, ", "ROMEO.",
    "Good morrow", "Come, sir,", "I pray you", "Why, then", "Exit.", "Thou art", "How now!",
]  # fmt: skip


def step_cost(path: str, batch: int, k: int, steps: int, dtype: str) -> float:
    """Seconds per decode step with `batch` requests each checking k forced proposals (k = 0: a
    plain decode step)."""
    options = {"dtype": dtype, "enable_prefix_caching": False, "speculative_max_running": batch}
    llm = LLM(path, speculative="ngram" if k else "off", speculative_k=max(k, 1), **options)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps * (k + 1) + 8, ignore_eos=True)
    prompts = [[(7 * i + j) % 200 + 50 for j in range(32)] for i in range(batch)]
    for i, prompt in enumerate(prompts):
        engine.add_group(f"b{i}", engine.plan([prompt], params))
    real = scheduler_module.propose, scheduler_module.keeps_proposing
    scheduler_module.propose = lambda tokens, ngram, room: [tokens[-1]] * room  # forced
    scheduler_module.keeps_proposing = lambda proposed, accepted: True
    try:
        engine.step()  # the prompts
        engine.step()  # first decode (allocations)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        return (time.perf_counter() - start) / steps
    finally:
        scheduler_module.propose, scheduler_module.keeps_proposing = real


def throughput(llm: LLM, prompts: list, max_tokens: int, temperature: float, wrong: bool) -> float:
    """Output tok/s; `wrong`: every proposal is a token the model does not pick (the worst case
    of text that does not repeat: proposals are checked and fail until the request stops)."""
    params = SamplingParams(  # seeded: the same output on and off (engine/speculative.py)
        temperature=temperature, seed=0, max_tokens=max_tokens, ignore_eos=True
    )
    real = scheduler_module.propose
    if wrong:
        vocab = llm.engine.loaded.arch.vocab_size
        scheduler_module.propose = lambda tokens, ngram, room: [
            (tokens[-1] * 7 + 1 + i) % vocab for i in range(room)
        ]
    try:  # generations repeated for a second at least (one of the demo's takes 0.1 s)
        start, tokens, elapsed = time.perf_counter(), 0, 0.0
        for _ in range(100):
            outs = llm.generate(prompts, params)
            tokens += sum(len(o.token_ids) for o in outs)
            elapsed = time.perf_counter() - start
            if elapsed >= 1.0:
                break
    finally:
        scheduler_module.propose = real
    return tokens / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per cost figure")
    args = p.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        smol = str(write_model(Path(tmp) / "smol", "llama", dtype=torch.bfloat16, **SMOLLM2_135M))
        models = {"demo": ("demo", "auto"), "SmolLM2-135M shape": (smol, "auto")}

        costs: dict[tuple[str, int, int], list[float]] = {}
        for repeat in range(args.repeats):
            for name, (path, dtype) in models.items():
                for batch in (1, 8):
                    for k in (0, 2, 4, 8):
                        s = step_cost(path, batch, k, args.steps, dtype)
                        costs.setdefault((name, batch, k), []).append(s)
                        console.log(f"{repeat} {name} batch {batch} k={k}: {s * 1e3:.2f} ms")
        table = Table(
            title="a verification step with k proposals per request / a plain decode step"
        )
        table.add_column("model")
        table.add_column("batch", justify="right")
        table.add_column("plain step", justify="right")
        for k in (2, 4, 8):
            table.add_column(f"k={k}", justify="right")
        step_costs = ResultTable(
            table.title or "",
            ["model", "batch", "plain step (ms)", *(f"k={k} / plain" for k in (2, 4, 8))],
            [],
        )
        for name in models:
            for batch in (1, 8):
                base = statistics.median(costs[name, batch, 0])
                ratios = [statistics.median(costs[name, batch, k]) / base for k in (2, 4, 8)]
                table.add_row(
                    name, str(batch), f"{base * 1e3:.2f} ms", *(f"{r:.2f}x" for r in ratios)
                )
                step_costs.rows.append(
                    [name, batch, round(base * 1e3, 2), *(round(r, 2) for r in ratios)]
                )
        Console().print(table)

        copy_prompt = PASSAGE * 2 + PASSAGE[:40]
        fresh = list(range(40, 72))
        openings = [OPENINGS[i % len(OPENINGS)] + " " * (i // len(OPENINGS)) for i in range(32)]
        loads = {
            "copy, greedy (demo, batch 1)": ("demo", [copy_prompt], 96, 0.0, False),
            "copy, temperature 0.7 (demo, batch 1)": ("demo", [copy_prompt], 96, 0.7, False),
            "loops, greedy (demo, batch 1)": ("demo", ["The king"], 192, 0.0, False),
            "SmolLM2 shape's greedy text (batch 1)": (smol, [fresh], 96, 0.0, False),
            "proposals that never hold (SmolLM2 shape, batch 1)": (smol, [fresh], 96, 0.0, True),
            "prose, temperature 1.0 (demo, batch 1)": ("demo", ["The king"], 192, 1.0, False),
            "batch 32, greedy (demo)": ("demo", openings, 96, 0.0, False),
        }  # fmt: skip
        engines = {  # made once: an engine made per measurement adds its own noise
            (path, mode): LLM(path, speculative=mode, enable_prefix_caching=False)
            for path in {load[0] for load in loads.values()}
            for mode in ("off", "ngram")
        }
        for llm in engines.values():
            llm.generate([[40, 41, 42]], SamplingParams(temperature=0.0, max_tokens=4))
        runs: dict[tuple[str, str], list[float]] = {}
        for repeat in range(args.repeats):
            for name, (path, prompts, n, temperature, wrong) in loads.items():
                order = ("off", "ngram") if repeat % 2 == 0 else ("ngram", "off")
                for mode in order:
                    tok_s = throughput(engines[path, mode], prompts, n, temperature, wrong)
                    runs.setdefault((name, mode), []).append(tok_s)
                    console.log(f"{repeat} {name} {mode}: {tok_s:.1f} tok/s")
        table = Table(title="output tok/s, speculation off vs on (ngram, k=4), medians")
        for column in ("workload", "off", "on", "on / off"):
            table.add_column(column, justify="right" if column != "workload" else "left")
        end_to_end = ResultTable(
            table.title or "", ["workload", "off tok/s", "on tok/s", "on / off"], []
        )
        for name in loads:
            off = statistics.median(runs[name, "off"])
            on = statistics.median(runs[name, "ngram"])
            table.add_row(name, f"{off:.1f}", f"{on:.1f}", f"{on / off:.2f}x")
            end_to_end.rows.append([name, round(off, 1), round(on, 1), round(on / off, 2)])
        Console().print(table)
    record(
        "bench_speculative",
        "Prompt-lookup speculation (ngram): a verification step's cost, and output tok/s off vs on",
        [step_costs, end_to_end],
        notes=f"Medians of {args.repeats} interleaved repeats.",
    )


if __name__ == "__main__":
    main()
