"""Long context over HTTP: decode speed at 1k-32k tokens of context with the KV bytes it takes,
and an agent's resent session, on `thermostat serve` with the prefix cache on.

    .venv/bin/python benchmarks/bench_long_context.py [--contexts 1024 8192 32768]
        [--kv-cache-dtypes auto fp8_e4m3] [--session 20000] [--turn 200] [--repeats 2]

Without --model it writes the SmolLM2-135M shape with random weights (bench_http.py's) with a
context of the longest length (plus room). Decode: a prompt of C fresh random token ids, then
`--new-tokens` tokens streamed (greedy, `ignore_eos`); the rate is the tokens after the first over
the time from the first to the last, and the KV bytes are C times the server's
`kv_bytes_per_token` (`/server_info`). Session: a `--session`-token prompt is sent once (its
prefill is the cold cost), then the same tokens plus a `--turn`-token new turn, as a coding agent
resends its conversation; that time to first token is compared with a fresh `--turn`-token
prompt's. `usage.prompt_tokens_details.cached_tokens` says how much of the resend the cache
served. One server per KV cache dtype, each alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from bench_http import prompts, random_model, serving
from results import Table, record, show
from rich.console import Console

console = Console(stderr=True)
VOCAB = 49152


def command(model: Path, kv_dtype: str, max_len: int, kv_gb: float) -> list[str]:
    return [
        ".venv/bin/thermostat", "serve", "--model", str(model), "--port", "{PORT}",
        "--served-model-name", "model", "--num-threads", "2", "--max-model-len", str(max_len),
        "--kv-cache-memory-gb", str(kv_gb), "--kv-cache-dtype", kv_dtype,
    ]  # fmt: skip


def completion(client: httpx.Client, url: str, ids: list[int]) -> tuple[float, int]:
    """Seconds to answer `ids` with one token, and the prompt tokens the cache served."""
    body = {"model": "model", "prompt": ids, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    response = client.post(f"{url}/v1/completions", json=body)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    return elapsed, details.get("cached_tokens") or 0


def decode_rate(client: httpx.Client, url: str, ids: list[int], new_tokens: int) -> float:
    """Tokens per second after the first, streaming `new_tokens` greedy tokens after `ids`."""
    body = {"model": "model", "prompt": ids, "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    stamps: list[float] = []
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            data = line.removeprefix("data: ")
            if data != line and data != "[DONE]" and json.loads(data)["choices"]:
                stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def measure(url: str, args: argparse.Namespace, seed: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with httpx.Client(timeout=args.timeout) as client:
        decode_rate(client, url, prompts(1, 128, VOCAB, seed=1)[0], 8)  # warm-up
        for context in args.contexts:
            ids = prompts(1, context, VOCAB, seed + context)[0]
            out[f"decode {context}"] = decode_rate(client, url, ids, args.new_tokens)
            console.print(f"  decode at {context:>6}: {out[f'decode {context}']:7.1f} tok/s")
        session, turn = prompts(2, args.session, VOCAB, seed)
        out["session cold"], _ = completion(client, url, session)
        out["resend"], cached = completion(client, url, session + turn[: args.turn])
        out["fresh turn"], _ = completion(client, url, prompts(1, args.turn, VOCAB, seed + 7)[0])
        out["cached"] = cached
        console.print(f"  session: {out}")
        out["kv_bytes_per_token"] = httpx.get(f"{url}/server_info").json()["kv_bytes_per_token"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="a Hugging Face model directory (default: random)")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8_e4m3"])
    p.add_argument("--new-tokens", type=int, default=65, help="tokens streamed per context")
    p.add_argument("--session", type=int, default=20000, help="the resent session's tokens")
    p.add_argument("--turn", type=int, default=200, help="the new turn's tokens")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kv-cache-memory-gb", type=float, default=4.0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a request may take")
    args = p.parse_args()
    max_len = max([*args.contexts, args.session + args.turn]) + args.new_tokens + 64
    runs: dict[str, list[dict[str, float]]] = {dtype: [] for dtype in args.kv_cache_dtypes}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or random_model(Path(tmp), max_position_embeddings=max_len)
        for repeat in range(args.repeats):
            for dtype in args.kv_cache_dtypes:
                console.print(f"[bold]repeat {repeat}: KV cache {dtype}[/bold]")
                cmd = command(model, dtype, max_len, args.kv_cache_memory_gb)
                with serving(f"long-context-{dtype}", cmd, Path(tmp)) as url:
                    runs[dtype].append(measure(url, args, seed=100 + repeat))
    report(runs, args)


def report(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    def median(dtype: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[dtype])

    first = args.contexts[0]
    decode_cols = ["KV cache", "context", "decode tok/s", f"vs {first}", "KV MB"]
    decode_rows: list[list[str | float | None]] = []
    session_cols = ["KV cache", f"{args.session}-token session, cold ms",
                    f"resent + {args.turn} new, ms", f"fresh {args.turn}, ms",
                    "resend / fresh", "cached tokens"]  # fmt: skip
    session_rows: list[list[str | float | None]] = []
    for dtype in runs:
        per_token = median(dtype, "kv_bytes_per_token")
        for context in args.contexts:
            rate = median(dtype, f"decode {context}")
            ratio = rate / median(dtype, f"decode {first}")
            kv_mb = context * per_token / 1e6
            decode_rows.append([dtype, context, round(rate, 1), round(ratio, 2), round(kv_mb, 1)])
        times = [median(dtype, k) for k in ("session cold", "resend", "fresh turn")]
        cached = int(median(dtype, "cached"))
        ms = [round(t * 1000) for t in times]
        session_rows.append([dtype, *ms, round(times[1] / times[2], 2), cached])
    tables = [
        Table(f"decode at long context, medians of {args.repeats}", decode_cols, decode_rows),
        Table(f"a resent session, medians of {args.repeats}", session_cols, session_rows),
    ]
    show(*tables)
    record(
        "bench_long_context",
        "Decode at long context and a resent agent session (prefix cache on)",
        tables,
        notes="Decode rate: the streamed tokens after the first over their time; KV MB: the "
        "context's tokens x the server's kv_bytes_per_token. The resend is the session's tokens "
        "plus a new turn after the session was sent once.",
        threads=2,
    )


if __name__ == "__main__":
    main()
