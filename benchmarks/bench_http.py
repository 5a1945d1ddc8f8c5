"""Output tokens/s over HTTP against the same engine offline, and against llama.cpp's
`llama-server` when a binary and a GGUF of the same weights are given, in one interleaved run.

    .venv/bin/python benchmarks/bench_http.py [--model DIR] [--concurrency 1 8 32] [--repeats 2]
        [--llama-server PATH/llama-server --gguf PATH/model-f16.gguf] [--json]

Without --model it writes a random-weight model shaped like SmolLM2-135M (bf16), as
bench_engine.py does; `../shared/peers/` builds llama-server and converts its `small` model.
Every load is 128 random prompt token ids and 128 new tokens per request (`ignore_eos`,
greedy: the sampler's cost is not what is compared), streamed, every chunk parsed as a client
would, by an aiohttp client on uvloop (the load generator of vLLM's and SGLang's serving
benchmarks; httpx spent 0.46 / 0.10 ms of CPU a token at c=1 / c=32 on 2 cores, aiohttp 0.20 /
0.04): concurrency C sends `max(C, 4)` requests (C at a time), and the offline engine gets the
same prompts through `LLM.generate`, C at a time (at c=1: the same four requests one after
another, so both sides do the same work over the same seconds of a noisy machine), each in its
own process with 2 torch threads. Every contender
starts once and stays up for the whole run; before the first measured load each runs one
unmeasured load per concurrency of the same shape on other prompts, so one-time costs (first
allocations, new matmul shapes, new connections) stay out of every figure alike. Each repeat
runs, per concurrency, every contender in turn (seconds apart, so a drift in the machine's noise
hits them alike; each waits idle while the others run); the table reports medians and the
HTTP/offline ratio. A second table says where the CPU went, in ms per output token: the offline
engine's process, the HTTP server's engine threads and its event loop (the main thread), the
load client (this process, during the HTTP loads) and llama-server's process. On 2 cores the
client's and the event loop's share is taken from the engine's threads: that is the gap between
HTTP and offline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import uvloop
from results import Table as ResultTable
from results import record
from rich.console import Console
from rich.table import Table

console = Console(stderr=True)
REPO = Path(__file__).resolve().parent.parent

OFFLINE = """
import json, sys, time
sys.path.insert(0, sys.argv[5])
from bench_http import prompts
from thermostat import LLM, SamplingParams
model, top, prompt_tokens, output_tokens = sys.argv[1], *map(int, sys.argv[2:5])
llm = LLM(model, num_threads=2, max_num_seqs=top, enable_prefix_caching=False)
params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
vocab = llm.engine.loaded.arch.vocab_size
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:  # "C SEED": max(C, 4) requests of those prompts (as HTTP), C at a time
    batch, seed = map(int, line.split())
    batch_prompts = prompts(max(batch, 4), prompt_tokens, vocab, seed)
    start, cpu = time.perf_counter(), time.process_time()
    outs = []
    for i in range(0, len(batch_prompts), batch):
        outs += llm.generate(batch_prompts[i : i + batch], params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.token_ids) for o in outs)
    print(json.dumps({"tok_s": tokens / elapsed, "cpu_ms": cpu * 1e3 / tokens}), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"server at {url} not ready after {timeout_s:.0f} s")


SERVER_PIDS: dict[str, int] = {}  # url -> pid of the server `serving` started there


@contextmanager
def serving(
    name: str, command: list[str], log_dir: Path, env: dict[str, str] | None = None
) -> Iterator[str]:
    """Run a server command (with {PORT}) until the block ends; yield its URL. `env`: variables
    set beside OMP_NUM_THREADS=2."""
    port = free_port()
    log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 (closed below)
    env = {**os.environ, "OMP_NUM_THREADS": "2", **(env or {})}
    proc = subprocess.Popen(
        [c.replace("{PORT}", str(port)) for c in command],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    SERVER_PIDS[url] = proc.pid
    try:
        wait_ready(url, proc)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids: the same prompts for the offline engine and over HTTP."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (batch, length), generator=gen).tolist()


async def stream_one(session: aiohttp.ClientSession, body: dict[str, Any]) -> int:
    """One streamed completion, every chunk parsed as a client would; its completion tokens."""
    tokens = 0
    async with session.post("/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:  # one SSE line at a time
            if not line.startswith(b"data:") or line.rstrip().endswith(b"[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens


@dataclass
class Run:
    """One measured load: output tokens/s and CPU ms per output token, by who spent it."""

    tok_s: float
    cpu_ms: dict[str, float] = field(default_factory=dict)


async def http_load_async(url: str, batch: list[list[int]], concurrency: int, args) -> Run:
    gate = asyncio.Semaphore(concurrency)
    # a connection per request: llama-server closes a kept-alive one after a stream
    connector = aiohttp.TCPConnector(limit=concurrency + 2, force_close=True)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:

        async def one(prompt: list[int]) -> int:
            body = {
                "model": "model",
                "prompt": prompt,
                "max_tokens": args.output_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with gate:
                return await stream_one(session, body)

        start, cpu = time.perf_counter(), time.process_time()
        tokens = await asyncio.gather(*(one(p) for p in batch))
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    if sum(tokens) != len(batch) * args.output_tokens:
        raise RuntimeError(
            f"{url}: {sum(tokens)} tokens generated, not {len(batch)} x {args.output_tokens}"
        )
    return Run(sum(tokens) / elapsed, {"load client": cpu * 1e3 / sum(tokens)})


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """CPU time each thread of a process has run so far (ns, the kernel's schedstat)."""
    times = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError, ValueError):  # the thread ended meanwhile
            times[int(tid)] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    return times


def http_run(
    url: str, concurrency: int, vocab: int, args: argparse.Namespace, seed: int | None = None,
    server: tuple[str, int] | None = None,
) -> Run:  # fmt: skip
    """A load over HTTP; with `server` (its name, its pid) the server's CPU per output token
    too: thermostat's event loop (the main thread) apart from its other (engine) threads."""
    size = max(concurrency, 4)
    batch = prompts(size, args.prompt_tokens, vocab, concurrency if seed is None else seed)
    before = thread_cpu_ns(server[1]) if server else {}
    run = uvloop.run(http_load_async(url, batch, concurrency, args))
    if server:
        name, pid = server
        spent = {t: ns - before.get(t, 0) for t, ns in thread_cpu_ns(pid).items()}
        per_token = 1e-6 / (size * args.output_tokens)
        if name == "thermostat":
            run.cpu_ms["server event loop"] = spent.pop(pid, 0) * per_token
            run.cpu_ms["server engine threads"] = sum(spent.values()) * per_token
        else:
            run.cpu_ms["server process"] = sum(spent.values()) * per_token
    return run


def http_load(
    url: str, concurrency: int, vocab: int, args: argparse.Namespace, seed: int | None = None
) -> float:
    return http_run(url, concurrency, vocab, args, seed).tok_s


@contextmanager
def offline_engine(model: Path, top: int, args: argparse.Namespace) -> Iterator[Any]:
    """The same engine offline, in its own process for the whole run (2 torch threads):
    yields load(C, seed) -> Run, the same requests as `http_load`'s."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.Popen(
        [sys.executable, "-c", OFFLINE, str(model), str(top), str(args.prompt_tokens),
         str(args.output_tokens), str(Path(__file__).parent)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None

    def load(concurrency: int, seed: int) -> Run:
        proc.stdin.write(f"{concurrency} {seed}\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the offline engine exited with {proc.wait()}")
        result = json.loads(line)
        return Run(result["tok_s"], {"offline engine process": result["cpu_ms"]})

    try:
        if not proc.stdout.readline():
            raise RuntimeError(f"the offline engine exited with {proc.wait()} before it was ready")
        yield load
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def random_model(directory: Path, max_position_embeddings: int | None = None) -> Path:
    """The SmolLM2-135M shape with random weights, and a word-level tokenizer that gives every
    one of its 49,152 ids a piece of text ("w123"): with the test suite's 300-token tokenizer
    nearly every generated id decodes to nothing, so a stream would carry no chunks and HTTP's
    per-chunk work would go unmeasured."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from thermostat.random_model import SMOLLM2_135M, write_model

    context = max_position_embeddings or SMOLLM2_135M["max_position_embeddings"]
    shape = dict(SMOLLM2_135M, max_position_embeddings=context)
    path = write_model(directory / "smollm2-135m-shape", "llama", dtype=torch.bfloat16, **shape)
    words = {"<|endoftext|>": 0} | {f"w{i}": i for i in range(1, SMOLLM2_135M["vocab_size"])}
    tok = Tokenizer(models.WordLevel(words, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = "<|endoftext|>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=eos)
    fast.save_pretrained(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="a Hugging Face model directory (default: random)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary")
    p.add_argument("--gguf", type=Path, help="the same weights as GGUF, for --llama-server")
    p.add_argument("--json", action="store_true", help="print the medians as JSON on stdout")
    args = p.parse_args()
    if (args.llama_server is None) != (args.gguf is None):
        p.error("--llama-server and --gguf go together")
    top = max(args.concurrency)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or random_model(Path(tmp))
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        thermostat = [
            sys.executable, "-m", "thermostat.cli", "serve", "--model", str(model),
            "--port", "{PORT}", "--served-model-name", "model", "--num-threads", "2",
            "--max-num-seqs", str(top),
            "--no-enable-prefix-caching",
        ]  # fmt: skip
        servers = {"thermostat (HTTP)": thermostat}
        if args.llama_server:
            servers["llama-server"] = [
                str(args.llama_server), "-m", str(args.gguf), "-t", "2", "-tb", "2",
                "-c", str(top * 512), "-np", str(top), "--host", "127.0.0.1", "--port", "{PORT}",
                "--no-webui",
            ]  # fmt: skip
        runs: dict[tuple[str, int], list[float]] = {}
        cpu: dict[tuple[str, int], list[float]] = {}  # (part, C) -> ms per token, per repeat
        with ExitStack() as stack:
            loads = {"thermostat (offline engine)": stack.enter_context(
                offline_engine(model, top, args)
            )}  # fmt: skip
            for name, command in servers.items():
                short = name.split()[0]
                url = stack.enter_context(serving(short, command, Path(tmp)))
                server = (short, SERVER_PIDS[url])
                loads[name] = partial(http_run, url, vocab=vocab, args=args, server=server)
            for load in loads.values():
                for c in args.concurrency:
                    load(c, seed=c + 1000)  # warm-up, same shape, other prompts
            for repeat in range(args.repeats):
                for c in args.concurrency:
                    for name, load in loads.items():
                        run = load(c, seed=c)
                        runs.setdefault((name, c), []).append(run.tok_s)
                        for part, ms in run.cpu_ms.items():
                            key = ("llama-server: " if name == "llama-server" else "") + part
                            cpu.setdefault((key, c), []).append(ms)
                        console.print(f"repeat {repeat} c={c} {name}: {run.tok_s:.1f} tok/s")
                    ratio = runs[("thermostat (HTTP)", c)][-1]
                    ratio /= runs[("thermostat (offline engine)", c)][-1]
                    console.print(f"repeat {repeat} c={c} HTTP / offline: {ratio:.2f}x")
    medians = {key: statistics.median(values) for key, values in runs.items()}
    names = ["thermostat (HTTP)", "thermostat (offline engine)", *list(servers)[1:]]
    columns = [f"c={c}" for c in args.concurrency]
    table = Table(title=f"output tok/s, {args.prompt_tokens}/{args.output_tokens} tokens, medians")
    tok_s = ResultTable(table.title or "", ["contender", *columns], [])
    table.add_column("contender")
    for c in args.concurrency:
        table.add_column(f"c={c}", justify="right")
    for name in names:
        table.add_row(name, *(f"{medians[(name, c)]:.1f}" for c in args.concurrency))
        tok_s.rows.append([name, *(round(medians[(name, c)], 1) for c in args.concurrency)])
    for name in names[1:]:
        ratios = [medians[("thermostat (HTTP)", c)] / medians[(name, c)] for c in args.concurrency]
        table.add_row(f"HTTP / {name}", *(f"{r:.2f}x" for r in ratios))
        tok_s.rows.append([f"HTTP / {name}", *(round(r, 2) for r in ratios)])
    console.print(table)
    where = Table(title="CPU ms per output token, medians (2 cores: 2 x wall ms per token in all)")
    cpu_ms = ResultTable(where.title or "", ["who", *columns], [])
    where.add_column("who")
    for c in args.concurrency:
        where.add_column(f"c={c}", justify="right")
    for part in dict.fromkeys(part for part, _ in cpu):
        ms = [statistics.median(cpu[(part, c)]) for c in args.concurrency]
        where.add_row(part, *(f"{m:.3f}" for m in ms))
        cpu_ms.rows.append([part, *(round(m, 3) for m in ms)])
    console.print(where)
    record(
        "bench_http",
        "Output tok/s over HTTP vs the same engine offline"
        + (" and llama-server" if args.llama_server else ""),
        [tok_s, cpu_ms],
        notes="Each engine runs 2 threads; on 2 cores the load client's and the event loop's CPU "
        "is taken from the engine's threads: that is the gap between HTTP and offline.",
        threads=2,
    )
    if args.json:
        print(json.dumps({f"{n}@{c}": v for (n, c), v in medians.items()}, indent=2))


if __name__ == "__main__":
    main()
