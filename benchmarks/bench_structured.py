"""Output tokens/s of JSON-schema-constrained decoding vs unconstrained, same requests.

    .venv/bin/python benchmarks/bench_structured.py [--model demo] [--batches 1 32]

Each batch size submits N requests at once, generating `--tokens` tokens each: unconstrained
with `ignore_eos`, constrained by a schema of one string property whose `minLength` keeps the
output going that long (so both runs generate the same number of tokens; the constrained run
also pays the grammar's mask and bookkeeping per token). Runs alternate `--repeats` times;
medians are reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

from results import Table, record

from thermostat import LLM, SamplingParams
from thermostat.sampling.structured import StructuredOutput


def run(llm: LLM, batch: int, params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(["It was the best of times"] * batch, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed, sum(len(o.token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model)
    schema = {
        "type": "object",
        "properties": {"text": {"type": "string", "minLength": 4 * args.tokens}},
        "required": ["text"],
    }
    spec = StructuredOutput.json_schema(schema, "response_format")
    free = SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=1.0, max_tokens=args.tokens, structured=spec)
    for batch in args.batches:  # warm up each shape
        run(llm, batch, free)
        run(llm, batch, constrained)
    print("| batch | unconstrained tok/s | json_schema tok/s | ratio |")
    print("|---|---|---|---|")
    rows: list[list[str | float | int | None]] = []
    for batch in args.batches:
        pairs = [
            (run(llm, batch, free)[0], run(llm, batch, constrained)[0]) for _ in range(args.repeats)
        ]
        a = statistics.median(p[0] for p in pairs)
        b = statistics.median(p[1] for p in pairs)
        ratio = b / a
        print(f"| {batch} | {a:.1f} | {b:.1f} | {ratio:.2f}x |")
        rows.append([batch, round(a, 1), round(b, 1), round(ratio, 2)])
    table = Table(
        f"output tok/s, {args.model} model, {args.tokens} tokens per request, medians of "
        f"{args.repeats}",
        ["batch", "unconstrained tok/s", "json_schema tok/s", "json_schema / unconstrained"],
        rows,
    )
    record("bench_structured", "JSON-schema-constrained decoding vs unconstrained", [table])


if __name__ == "__main__":
    main()
