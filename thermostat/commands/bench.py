"""`thermostat bench URL`: a load generator for any OpenAI-compatible server.

Each request streams a completion of a random-word prompt (about `--prompt-tokens` tokens: one
word is roughly one token) with `max_tokens=--output-tokens` and `ignore_eos`, so every request
does the same work. Requests go out either `--concurrency` at a time or as a Poisson process of
`--request-rate` per second. Bounded: `--num-requests` in count, `--max-duration` in time
(requests still running then are cancelled and counted as errors).

Measured per request: TTFT (send to first text), ITL (gaps between text chunks), output tokens
(from the usage chunk; the number of text chunks if the server sends none).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

HELP = "load-test any OpenAI-compatible server (TTFT, ITL, throughput)"
EPILOG = """examples:
  thermostat bench http://127.0.0.1:8000 --num-requests 200 --concurrency 16
  thermostat bench http://127.0.0.1:8000 --request-rate 4 --prompt-tokens 512 --output-tokens 64
  thermostat bench https://host/v1 --model NAME --api-key "$KEY" --json > result.json

exit status: 0 every request succeeded, 1 some failed, 2 bad flags.
"""

_WORD_TEXT = """
time person year way day thing man world life hand part child eye woman
place work week case point government company number group problem fact river mountain city
garden window music paper story letter question answer morning evening winter summer light water
stone fire voice friend house table road field forest ocean island bridge market school
doctor teacher animal bird flower tree cloud rain wind star moon sun color green
blue red yellow
"""
WORDS = _WORD_TEXT.split()


@dataclass
class Result:
    ok: bool
    latency_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="server base URL, e.g. http://127.0.0.1:8000 (a /v1 suffix is ok)")
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument(
        "--endpoint", choices=["completions", "chat"], default="completions", help="the API to load"
    )
    p.add_argument("--num-requests", type=int, default=100, help="requests in the run")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="requests in flight at once (default 8)")
    load.add_argument("--request-rate", type=float, help="Poisson arrivals per second")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (random words)")
    p.add_argument("--output-tokens", type=int, default=128, help="max_tokens, with ignore_eos")
    p.add_argument(
        "--temperature",
        type=float,
        help="sent with every request (default: not sent, so the server's defaults apply)",
    )
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--max-duration", type=float, default=600.0, help="seconds for the whole run")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrivals")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    """Exit code 0 when every request succeeded, 1 otherwise."""
    for name in ("num_requests", "prompt_tokens", "output_tokens"):
        if getattr(args, name) < 1:
            print(
                f"thermostat bench: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr
            )
            return 2
    summary = asyncio.run(bench(args))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        Console().print(summary_table(summary))
    return 0 if summary["errors"] == 0 else 1


def base_url(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


def make_prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def payload(args: argparse.Namespace, model: str, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": args.output_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.temperature is not None:
        body["temperature"] = args.temperature
    if args.endpoint == "chat":
        return body | {"messages": [{"role": "user", "content": prompt}]}
    return body | {"prompt": prompt}


async def one_request(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Result:
    start = time.perf_counter()
    ttft, last, itl, chunks, tokens = None, start, [], 0, None
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                return Result(
                    False, time.perf_counter() - start, error=f"{response.status_code}: {detail}"
                )
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Result(False, time.perf_counter() - start, error=str(chunk["error"]))
                if chunk.get("usage"):
                    tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if ttft is None:
                            ttft = now - start
                        else:
                            itl.append(now - last)
                        last, chunks = now, chunks + 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Result(False, time.perf_counter() - start, error=repr(exc))
    latency = time.perf_counter() - start
    return Result(True, latency, ttft, itl, tokens if tokens is not None else chunks)


async def find_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    concurrency = args.concurrency or (args.num_requests if args.request_rate else 8)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=base_url(args.url), headers=headers, timeout=args.timeout, limits=limits
    ) as client:
        model = args.model or await find_model(client)
        bodies = [
            payload(args, model, make_prompt(rng, args.prompt_tokens))
            for _ in range(args.num_requests)
        ]
        results: list[Result] = []
        gate = asyncio.Semaphore(concurrency)
        with Progress(console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task("requests", total=len(bodies))

            async def send(body: dict[str, Any], delay: float) -> None:
                await asyncio.sleep(delay)
                async with gate:
                    results.append(await one_request(client, path, body))
                progress.advance(task)

            delays, t = [], 0.0
            for _ in bodies:
                delays.append(t)
                if args.request_rate:
                    t += rng.expovariate(args.request_rate)
            start = time.perf_counter()
            tasks = [asyncio.create_task(send(b, d)) for b, d in zip(bodies, delays, strict=True)]
            _, pending = await asyncio.wait(tasks, timeout=args.max_duration)
            for late in pending:
                late.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            duration = time.perf_counter() - start
    results += [Result(False, duration, error="cancelled: --max-duration reached") for _ in pending]
    return summarize(results, duration, model, args)


def percentiles(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)

    def at(q: float) -> float | None:
        if not ordered:
            return None
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def summarize(
    results: list[Result], duration: float, model: str, args: argparse.Namespace
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {
        "url": args.url,
        "model": model,
        "endpoint": args.endpoint,
        "requests": len(results),
        "completed": len(ok),
        "errors": len(errors),
        "error_examples": sorted(set(e for e in errors if e))[:5],
        "duration_s": duration,
        "requests_per_s": len(ok) / duration if duration else 0.0,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration if duration else 0.0,
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl_s]),
        "latency_s": percentiles([r.latency_s for r in ok]),
        "config": {k: v for k, v in vars(args).items() if k not in ("run", "api_key")},
    }


def summary_table(summary: dict[str, Any]) -> Table:
    table = Table(title=f"thermostat bench: {summary['model']} at {summary['url']}")
    table.add_column("metric")
    table.add_column("value", justify="right")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f} ms"

    table.add_row("requests (completed / sent)", f"{summary['completed']} / {summary['requests']}")
    table.add_row("errors", str(summary["errors"]))
    table.add_row("duration", f"{summary['duration_s']:.2f} s")
    table.add_row("requests/s", f"{summary['requests_per_s']:.2f}")
    table.add_row("output tokens/s", f"{summary['output_tokens_per_s']:.1f}")
    for name in ("ttft_s", "itl_s"):
        label = "TTFT" if name == "ttft_s" else "ITL"
        for q, value in summary[name].items():
            table.add_row(f"{label} {q}", ms(value))
    for example in summary["error_examples"]:
        table.add_row("error", example[:80])
    return table
