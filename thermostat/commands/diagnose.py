"""`thermostat diagnose`: the case study's differential diagnosis as one command.

The same prompts run across factors; each cell's degeneration rate is measured with
`thermostat.quality`; the factor whose change turns degeneration on and off is named.

| factor        | levels                                                                 |
|---------------|------------------------------------------------------------------------|
| decoding      | greedy (temperature 0), the resolved defaults, the family recommendation |
| KV cache      | fp8_e4m3, full precision (local model only)                            |
| weights       | as the checkpoint stores them, int8, int4 (`--weights`; local only)    |
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from thermostat.quality import analyze
from thermostat.sampling.params import SamplingParams

HELP = (
    "find what makes a model degenerate: greedy decoding, KV cache quantization, weight "
    "quantization, or none of them"
)
EPILOG = """examples:
  thermostat diagnose --model demo
  thermostat diagnose --model ./my-model --prompts prompts.txt --max-tokens 300
  thermostat diagnose --model ./my-model --weights checkpoint,int8,int4
  thermostat diagnose --url http://127.0.0.1:8000 --model NAME     # decoding factor only

exit status: 0 no degeneration found, 1 degeneration found (the cause is named), 2 bad usage.
"""

DEFAULT_PROMPTS = [
    "The king looked out over the hall and said",
    "It was late in the evening when the letter came",
    "Once upon a time, in a village by the sea,",
    "The first thing you should know about the old house is",
    "She opened the door and saw",
    "Here is a list of the things we need:",
    "My lord, I have news from the north.",
    "The committee met on Tuesday to discuss",
]
EFFECT = 0.10  # a factor explains degeneration when switching it moves the rate this much,
SIGNIFICANCE = 0.05  # and the move is no chance at these counts (one-sided Fisher exact test)


@dataclass
class Cell:
    decoding: str  # "greedy" | "defaults" | "recommended"
    kv_cache: str  # "fp8_e4m3" | "full" | "remote"
    weights: str  # "checkpoint" | "int8" | "int4" | "remote"
    generations: int
    degenerate: int
    example: str  # a reason from a degenerate generation, if any

    @property
    def rate(self) -> float:
        return self.degenerate / self.generations if self.generations else 0.0


def decoding_levels(recommended: dict | None, seed: int) -> dict[str, dict]:
    """Sampling fields for each decoding level (fields omitted = server/engine defaults)."""
    levels: dict[str, dict] = {"greedy": {"temperature": 0.0}, "defaults": {"seed": seed}}
    if recommended:
        levels["recommended"] = dict(recommended) | {"seed": seed}
    return levels


def measure(
    generate: Callable[[list[str], dict], list[str]], prompts: list[str], fields: dict
) -> tuple[int, str]:
    texts = generate(prompts, fields)
    reports = [analyze(t) for t in texts]
    bad = [r for r in reports if r.degenerate]
    return len(bad), (bad[0].reasons[0] if bad and bad[0].reasons else "")


def one_sided_p(bad: int, n: int, other_bad: int, other_n: int) -> float:
    """P(at least `bad` of `n` degenerate) if both groups shared one rate: Fisher's exact test,
    the hypergeometric tail over the pooled counts."""
    total, pooled = n + other_n, bad + other_bad
    tail = sum(
        math.comb(pooled, x) * math.comb(total - pooled, n - x)
        for x in range(bad, min(pooled, n) + 1)
    )
    return tail / math.comb(total, n)


def conclude(cells: list[Cell]) -> tuple[str, str]:
    """(cause, explanation) from the per-cell counts: a factor is a cause when the rate with it
    exceeds the rate without by EFFECT and no chance explains that (SIGNIFICANCE). Greedy
    decoding is set against the sampled level that degenerates least."""

    def counts(pred) -> tuple[int, int]:
        chosen = [c for c in cells if pred(c)]
        return sum(c.degenerate for c in chosen), sum(c.generations for c in chosen)

    def rate(pred) -> float:
        bad, n = counts(pred)
        return bad / max(n, 1)

    def explains(with_it, without) -> bool:
        (bad, n), (other_bad, other_n) = counts(with_it), counts(without)
        if not n or not other_n or bad / n - other_bad / other_n < EFFECT:
            return False
        return one_sided_p(bad, n, other_bad, other_n) < SIGNIFICANCE

    levels = list(dict.fromkeys(c.decoding for c in cells if c.decoding != "greedy"))
    best = min(levels, key=lambda lv: rate(lambda c: c.decoding == lv), default=None)
    greedy = rate(lambda c: c.decoding == "greedy")
    fp8, full = rate(lambda c: c.kv_cache == "fp8_e4m3"), rate(lambda c: c.kv_cache == "full")
    stored = rate(lambda c: c.weights == "checkpoint")
    quantized = {w: rate(lambda c, w=w: c.weights == w) for w in ("int8", "int4")}
    quantized = {w: r for w, r in quantized.items() if any(c.weights == w for c in cells)}
    causes = []
    if best is not None and explains(
        lambda c: c.decoding == "greedy", lambda c: c.decoding == best
    ):
        causes.append("greedy decoding")
    if any(c.kv_cache == "full" for c in cells) and explains(
        lambda c: c.kv_cache == "fp8_e4m3", lambda c: c.kv_cache == "full"
    ):
        causes.append("KV cache quantization")
    if any(
        explains(lambda c, w=w: c.weights == w, lambda c: c.weights == "checkpoint")
        for w in quantized
    ):
        causes.append("weight quantization")
    sampled = ", ".join(f"{lv} {rate(lambda c, lv=lv: c.decoding == lv):.0%}" for lv in levels)
    summary = f"degeneration rate: greedy {greedy:.0%} vs sampled {sampled}" + (
        f"; fp8 KV {fp8:.0%} vs full {full:.0%}" if any(c.kv_cache == "full" for c in cells) else ""
    )
    summary += "".join(f"; {w} weights {r:.0%}" for w, r in quantized.items())
    if quantized:
        summary += f" vs checkpoint {stored:.0%}"
    if causes:
        return " and ".join(causes), summary
    if max(rate(lambda c: True), greedy) >= EFFECT:
        return (
            "neither",
            summary + ": degeneration follows none of the factors (look at the model or prompts)",
        )
    return "neither", summary + ": no degeneration found"


def local_generator(
    model: str, kv_cache: str, weights: str, max_tokens: int, options: dict, chat: bool = False
):
    """`chat`: each prompt a user message through the model's chat template (LLM.chat)."""
    from thermostat import LLM

    quantization = None if weights == "checkpoint" else weights
    llm = LLM(model, kv_cache_dtype=kv_cache, quantization=quantization, **options)

    def generate(prompts: list[str], fields: dict) -> list[str]:
        params = SamplingParams(max_tokens=max_tokens, **fields)
        if chat:
            conversations = [[{"role": "user", "content": p}] for p in prompts]
            return [o.text for o in llm.chat(conversations, params)]
        return [o.text for o in llm.generate(prompts, params)]

    return llm, generate


def remote_generator(
    url: str, model: str | None, api_key: str | None, max_tokens: int, endpoint: str
):
    from thermostat.quality.server_checks import Client

    client = Client(url, model, api_key, endpoint=endpoint)

    def generate(prompts: list[str], fields: dict) -> list[str]:
        return [client.complete(p, max_tokens=max_tokens, **fields)["text"] for p in prompts]

    return client, generate


def keep_on_console(url: str, api_key: str | None, result: dict) -> str:
    """Hand the result to the diagnosed server's console (Thermostat serve or gateway), which
    shows the last one; what happened, as a line for the terminal."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    target = url.rstrip("/") + "/v1/console/diagnose"
    try:
        r = httpx.post(target, json=result, headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        return f"the result was not kept on the server's console: {exc}"
    if r.status_code == 200:
        return f"the result is on the server's console: {url.rstrip('/')}/console"
    return f"the result was not kept on the server's console ({r.status_code} from {target})"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="model directory ('demo'), or name with --url")
    p.add_argument("--url", help="diagnose a running server (decoding factor only)")
    p.add_argument("--api-key", help="with --url: sent as Authorization: Bearer KEY")
    p.add_argument(
        "--endpoint",
        choices=["completions", "chat", "responses", "messages"],
        default="completions",
        help="the API the probes go through (with --url: as `verify --endpoint`); on a local "
        "model, chat renders each prompt as a user message through its chat template",
    )
    p.add_argument("--prompts", type=Path, help="a text file, one prompt per line")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens per answer")
    p.add_argument("--seed", type=int, default=0, help="the first sampled answer's seed")
    p.add_argument("--dtype", default="auto", help="the compute dtype, as for serve")
    p.add_argument(
        "--weights",
        default="checkpoint,int8",
        help="weight formats to compare, comma-separated: checkpoint (as stored), int8, int4",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    prompts = DEFAULT_PROMPTS
    if args.prompts:
        try:
            prompts = [line for line in args.prompts.read_text().splitlines() if line.strip()]
        except OSError as exc:
            console.print(f"[red]error:[/] cannot read {args.prompts}: {exc}")
            return 2
        if not prompts:
            console.print(f"[red]error:[/] {args.prompts} has no prompts")
            return 2
    weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    unknown = sorted(set(weights) - {"checkpoint", "int8", "int4"})
    if unknown or not weights:
        console.print(f"[red]error:[/] --weights takes checkpoint, int8, int4; got {args.weights}")
        return 2
    cells: list[Cell] = []
    try:
        if args.url:
            client, generate = remote_generator(
                args.url,
                args.model if args.model != "demo" else None,
                args.api_key,
                args.max_tokens,
                args.endpoint,
            )
            setups: list[tuple[str, str, Callable, dict | None]] = [
                ("remote", "remote", generate, None)
            ]
        else:
            from thermostat.sampling.recommendations import recommendation_for

            setups = []
            for w in weights:
                for kv in ("full", "fp8_e4m3"):
                    console.log(f"loading {args.model} with {w} weights, {kv} KV cache")
                    llm, generate = local_generator(
                        args.model,
                        "auto" if kv == "full" else kv,
                        w,
                        args.max_tokens,
                        {"dtype": args.dtype},
                        chat=args.endpoint != "completions",
                    )
                    rec = recommendation_for(llm.engine.loaded.config_dict)
                    setups.append((kv, w, generate, rec.values if rec else None))
        for kv, w, generate, recommended in setups:
            for level, fields in decoding_levels(recommended, args.seed).items():
                console.log(f"{level} decoding, {kv} KV cache, {w} weights: {len(prompts)} prompts")
                bad, example = measure(generate, prompts, fields)
                cells.append(Cell(level, kv, w, len(prompts), bad, example))
    except Exception as exc:  # a model that will not load, a server that will not answer
        console.print(f"[red]error:[/] {exc}")
        return 2
    cause, explanation = conclude(cells)
    result = {
        "cause": cause,
        "explanation": explanation,
        "cells": [asdict(c) | {"rate": c.rate} for c in cells],
    }
    if args.url:
        console.print(keep_on_console(args.url, args.api_key, result))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        table = Table(title="degeneration by factor")
        for col in ("decoding", "KV cache", "weights", "degenerate", "example reason"):
            table.add_column(col, overflow="fold")
        for c in cells:
            table.add_row(
                c.decoding, c.kv_cache, c.weights, f"{c.degenerate}/{c.generations}", c.example
            )
        Console().print(table)
        Console().print(f"cause: [bold]{cause}[/] — {explanation}")
    return 0 if all(c.degenerate == 0 for c in cells) else 1
