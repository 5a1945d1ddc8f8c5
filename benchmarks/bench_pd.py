"""Prefill/decode disaggregation: what handing a prompt's KV over costs, and what the split
topology (prefill + decode + smg) gives a client against one plain server, in one run.

    .venv/bin/python benchmarks/bench_pd.py [--model DIR] [--kv-lengths 128 1024 4096]
        [--kv-dtypes bfloat16 fp8_e4m3] [--kv-repeats 5] [--concurrency 1 4] [--requests 8]
        [--skip-kv | --skip-topology] [--log-dir DIR] [--json]

Without --model it writes a random-weight model shaped like SmolLM2-135M (bf16), as
bench_http.py does, with its context raised so that the longest --kv-lengths prompt fits.

1. KV transfer. For each KV dtype the model is loaded once in this process
   (`thermostat.LLM(model, kv_cache_dtype=...)`, 2 torch threads); each prompt length is
   prefilled the way a prefill server does it (`add_group(..., handoff=True)`, stepped until
   the handoff delta), converted with `disagg.handoff.pack_handoff`, then handed over
   `--kv-repeats` times through the real bootstrap path on loopback TCP: `RoomTable.put` on a
   `BootstrapServer` bound to 127.0.0.1, `await claim(...)` from the same event loop, a fresh room
   each time (one unmeasured claim first). The table splits a handoff's time into the prefill
   engine's `cache.export` of the prompt's rows, the claim (connect, frames, pack, receive,
   unpack: both ends run on this one thread) and the decode engine's `cache.load` of the
   received rows; it reports medians, bytes per token, MB per handoff and the claim's MB/s
   (MB = 10**6 bytes). The received rows are checked equal to the sent ones.
2. Topology vs one server. One `thermostat serve` (--num-threads 2), stopped, then a prefill and
   a decode server (--num-threads 1 each) behind smg (`thermostat.disagg.launcher` /
   `router` helpers: the argv `thermostat pd` uses), all on 127.0.0.1 with free ports, prefix
   caching off. Each gets one unmeasured warm-up load, then for each concurrency C a load of
   max(C, --requests) streamed completions, C at a time: prompts of random tokens of exactly
   --prompt-tokens (128) tokens, sent as text (smg 1.13.0 refuses a `prompt` of token ids:
   "data did not match any variant of untagged enum StringOrArray"), --output-tokens new tokens
   (64), greedy, `ignore_eos`, every SSE chunk parsed as a client would. Each request asks
   `logprobs: 0` (the sampled token's only): the random model's small tokenizer decodes most of
   its 49152 ids to no text, and a server sends no chunk for a token without text or logprobs.
   TTFT is client side, from sending the request to the first chunk carrying a token; output
   tok/s is completion tokens (`usage`, checked against the tokens streamed) over the load's
   wall time. Children stop with SIGTERM
   (the router first), SIGKILL after --stop-grace; smg is stopped by its PID (it renames
   itself `smg::router`).

An honest note on part 2: on a 2-core machine the PD topology's two engines share the same two
cores the single server has to itself (1 thread each, plus the router), so the ratio measures
the overhead of the split (the extra hop, the KV handoff, a prefill engine and a decode engine
that cannot lend each other their core) and not the capacity gain that separate machines for
prefill and decode would bring. Logs of every child are kept in --log-dir (default: a temporary
directory, printed).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import itertools
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch
from results import Table as ResultTable
from results import record
from rich.console import Console
from rich.table import Table

from thermostat import LLM, SamplingParams
from thermostat.disagg.bootstrap import BootstrapServer, claim
from thermostat.disagg.children import (
    Child,
    LaunchError,
    free_ports,
    local_url,
    start,
    stop,
    wait_ready,
)
from thermostat.disagg.handoff import pack_handoff, unpack_handoff
from thermostat.disagg.launcher import ROUTER_READY_TIMEOUT_S, SERVER_CMD, Plan, serve_argv
from thermostat.disagg.rooms import PackedHandoff, RoomTable
from thermostat.disagg.router import ROUTER_READY_PATH, RouterConfig, find_smg, smg_command
from thermostat.engine.steps import Handoff

console = Console(stderr=True)
MB = 1e6
MAX_PREFILL_STEPS = 10_000  # bounds the stepping loop of one prefill
CLAIM_TIMEOUT_S = 60.0
LOAD_TIMEOUT_S = 900.0  # one whole load of streamed completions
ROOMS = itertools.count(1)  # a fresh room id per handoff


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (batch, length), generator=gen).tolist()


def text_prompts(model: Path, batch: int, length: int, seed: int) -> list[str]:
    """Texts that the model's tokenizer encodes (as the server does, special tokens included) to
    exactly `length` tokens: random words that are each one token (" was", " times", ...), since
    smg 1.13.0 refuses a `prompt` of token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    words = []
    for i in range(len(tok)):
        word = tok.decode([i])
        alpha = word[1:].isascii() and word[1:].isalpha()
        if word.startswith(" ") and alpha and tok.encode(word, add_special_tokens=False) == [i]:
            words.append(word)
    added = len(tok.encode("x", add_special_tokens=True)) - len(
        tok.encode("x", add_special_tokens=False)
    )
    if len(words) < 2 or length <= added:
        raise RuntimeError(f"{model}: too few one-token words for random text prompts")
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batch):
        picks = torch.randint(len(words), (length - added,), generator=gen).tolist()
        text = "".join(words[i] for i in picks)
        got = len(tok.encode(text, add_special_tokens=True))
        if got != length:
            raise RuntimeError(f"a random text prompt of {got} tokens, not {length}")
        out.append(text)
    return out


def random_model(directory: Path, context: int) -> Path:
    from thermostat.random_model import SMOLLM2_135M, write_model

    shape = dict(SMOLLM2_135M)
    shape["max_position_embeddings"] = max(shape["max_position_embeddings"], context)
    return write_model(directory / "smollm2-135m-shape", "llama", dtype=torch.bfloat16, **shape)


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start_s = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start_s)
    return times


# -- 1. KV transfer ---------------------------------------------------------------------------


Slots = torch.Tensor | list[torch.Tensor]  # what `cache.export` takes: one tensor or one per pool


def prefill(llm: LLM, prompt: list[int], group: str) -> tuple[Handoff, Slots]:
    """The prompt's handoff as a prefill server gets it, and the cache slots its rows came from
    (caught on their way into `cache.export`; they stay intact until the engine's next step)."""
    engine = llm.engine
    export = engine.cache.export
    slots: list[Slots] = []

    def spy(s: Slots) -> Any:
        slots.append(s.clone() if isinstance(s, torch.Tensor) else [t.clone() for t in s])
        return export(s)

    engine.cache.export = spy  # type: ignore[method-assign]
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1)
        engine.add_group(group, engine.plan([prompt], params), handoff=True)
        prefilled = None
        for _ in range(MAX_PREFILL_STEPS):
            if not engine.has_unfinished():
                break
            for delta in engine.step():
                if delta.handoff is not None:
                    prefilled = delta.handoff
        else:
            raise RuntimeError(f"the prefill of {len(prompt)} tokens did not end")
    finally:
        del engine.cache.export  # the method again
    if prefilled is None or len(slots) != 1:
        raise RuntimeError(f"no handoff for the prompt of {len(prompt)} tokens")
    return prefilled, slots[0]


async def hand_over(handoff: PackedHandoff, repeats: int) -> tuple[list[float], PackedHandoff]:
    """Claim times of `repeats` handoffs over loopback (after one unmeasured), each in a room
    never used before; the last one received."""
    table = RoomTable(ttl_s=CLAIM_TIMEOUT_S)
    server = BootstrapServer(table, claim_timeout_s=CLAIM_TIMEOUT_S)
    await server.start("127.0.0.1", 0)
    times: list[float] = []
    got = handoff
    try:
        for i in range(repeats + 1):
            room = next(ROOMS)
            table.put(room, handoff)
            start_s = time.perf_counter()
            got = await claim("127.0.0.1", server.port, room, "bench_pd", CLAIM_TIMEOUT_S)
            if i:
                times.append(time.perf_counter() - start_s)
    finally:
        await server.close()
    return times, got


def kv_transfer(model: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for kv_dtype in args.kv_dtypes:
        rows += kv_transfer_one(model, kv_dtype, args)
        gc.collect()  # the engine of this dtype, before the next loads its own
    return rows


def kv_transfer_one(model: Path, kv_dtype: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    console.print(f"KV transfer: loading the model with {kv_dtype} KV")
    llm = LLM(
        str(model),
        kv_cache_dtype=kv_dtype,
        num_threads=args.threads,
        enable_prefix_caching=False,
        max_num_seqs=1,
    )
    vocab = llm.engine.loaded.arch.vocab_size
    cache = llm.engine.cache
    rows = []
    for length in args.kv_lengths:
        prompt = prompts(1, length, vocab, seed=length)[0]
        start_s = time.perf_counter()
        prefilled, slots = prefill(llm, prompt, f"kv-{kv_dtype}-{length}")
        prefill_s = time.perf_counter() - start_s
        export_s = timed(functools.partial(cache.export, slots), args.kv_repeats)
        handoff = pack_handoff(prefilled, {"benchmark": "bench_pd", "kv_cache_dtype": kv_dtype})
        claim_s, got = asyncio.run(hand_over(handoff, args.kv_repeats))
        received, _ = unpack_handoff(got)
        sent = prefilled.rows.tensors
        if received.rows.tensors.keys() != sent.keys() or not all(
            torch.equal(received.rows.tensors[k], t) for k, t in sent.items()
        ):
            raise RuntimeError(f"{kv_dtype} {length}: the received rows differ from the sent")
        load_s = timed(functools.partial(cache.load, slots, received.rows), args.kv_repeats)
        nbytes = handoff.nbytes
        row = {
            "kv_cache_dtype": kv_dtype,
            "prompt_tokens": length,
            "bytes_per_token": nbytes / length,
            "mb_per_handoff": nbytes / MB,
            "prefill_s": prefill_s,
            "export_ms": statistics.median(export_s) * 1e3,
            "claim_ms": statistics.median(claim_s) * 1e3,
            "claim_mb_s": nbytes / MB / statistics.median(claim_s),
            "load_ms": statistics.median(load_s) * 1e3,
        }
        row["total_ms"] = row["export_ms"] + row["claim_ms"] + row["load_ms"]
        rows.append(row)
        console.print(
            f"  {kv_dtype} {length} tokens: prefill {prefill_s:.1f} s, "
            f"{row['mb_per_handoff']:.1f} MB, claim {row['claim_ms']:.1f} ms "
            f"({row['claim_mb_s']:.0f} MB/s)"
        )
    return rows


def kv_table(
    rows: list[dict[str, Any]], args: argparse.Namespace, cpu: str
) -> tuple[Table, ResultTable]:
    """The printed table and the same as a result (numbers at the printed precision)."""
    table = Table(
        title=f"KV handoff over loopback TCP (prefill -> decode, one process), {cpu}, "
        f"{args.threads} torch threads, medians of {args.kv_repeats}"
    )
    columns = ["KV dtype", "prompt tok", "bytes/tok", "MB/handoff", "export ms", "claim ms"]
    columns += ["claim MB/s", "load ms", "total ms"]
    for name in columns:
        table.add_column(name, justify="left" if name == "KV dtype" else "right")
    recorded = ResultTable(table.title or "", columns, [])
    for r in rows:
        cells = [
            r["kv_cache_dtype"],
            r["prompt_tokens"],
            round(r["bytes_per_token"]),
            round(r["mb_per_handoff"], 2),
            round(r["export_ms"], 2),
            round(r["claim_ms"], 2),
            round(r["claim_mb_s"]),
            round(r["load_ms"], 2),
            round(r["total_ms"], 2),
        ]
        recorded.rows.append(cells)
        table.add_row(
            r["kv_cache_dtype"],
            str(r["prompt_tokens"]),
            f"{r['bytes_per_token']:.0f}",
            f"{r['mb_per_handoff']:.2f}",
            f"{r['export_ms']:.2f}",
            f"{r['claim_ms']:.2f}",
            f"{r['claim_mb_s']:.0f}",
            f"{r['load_ms']:.2f}",
            f"{r['total_ms']:.2f}",
        )
    return table, recorded


# -- 2. Topology vs one server ----------------------------------------------------------------


def common_serve_args(args: argparse.Namespace) -> list[str]:
    return [
        "--served-model-name", "model", "--no-enable-prefix-caching",
        "--max-num-seqs", str(max(args.concurrency)), "--kv-cache-memory-gb", "0.25",
    ]  # fmt: skip


def report_exits(children: list[Child]) -> None:
    for child in children:
        code = child.proc.returncode
        style = "green" if code == 0 else "yellow"
        console.print(f"  [{style}]{child.exit_reason()}[/] (log {child.log})", highlight=False)


@contextmanager
def single_server(model: Path, args: argparse.Namespace, log_dir: Path) -> Iterator[str]:
    (port,) = free_ports(1)
    extra = [*common_serve_args(args), "--num-threads", "2"]
    argv = [*SERVER_CMD, *serve_argv(None, str(model), port, extra=extra)]
    url = local_url("127.0.0.1", port)
    children = [start("single", argv, url + "/health", log_dir)]
    try:
        wait_ready(children, args.startup_timeout)
        yield url
    finally:
        stop(children, args.stop_grace)
        report_exits(children)


@contextmanager
def pd_topology(model: Path, args: argparse.Namespace, log_dir: Path, smg: str) -> Iterator[str]:
    """A prefill and a decode server, then smg in front once both are ready; the router's URL.
    Stops the router first, then both servers, as `thermostat pd` does."""
    prefill_port, decode_port, bootstrap, router_port, prometheus = free_ports(5)
    router = RouterConfig(
        port=router_port,
        prometheus_port=prometheus,
        prefill_url=local_url("127.0.0.1", prefill_port),
        bootstrap_port=bootstrap,
        decode_url=local_url("127.0.0.1", decode_port),
        worker_startup_timeout_secs=max(1, round(args.startup_timeout)),
        shutdown_grace_secs=5,  # nothing is in flight when it stops
        log_level="warn",
    )
    plan = Plan(
        model=str(model),
        router=router,
        smg=smg,
        log_dir=log_dir,
        serve_args=(*common_serve_args(args), "--num-threads", "1"),
        startup_timeout_s=args.startup_timeout,
        stop_grace_s=args.stop_grace,
    )
    servers: list[Child] = []
    routers: list[Child] = []
    try:
        for role in ("prefill", "decode"):
            argv, ready_url = plan.server(role)  # type: ignore[arg-type]
            servers.append(start(role, argv, ready_url, log_dir))
        wait_ready(servers, args.startup_timeout)
        routers.append(
            start("router", smg_command(router, smg), plan.url + ROUTER_READY_PATH, log_dir)
        )
        wait_ready(routers, ROUTER_READY_TIMEOUT_S, running=servers)
        yield plan.url
    finally:
        stop(routers, args.stop_grace)
        stop(servers, args.stop_grace)
        report_exits([*routers, *servers])


async def stream_one(
    client: httpx.AsyncClient, body: dict[str, Any], prompt_tokens: int
) -> tuple[float, int]:
    """One streamed completion, every chunk parsed: (seconds to the first chunk carrying a token,
    completion tokens). The tokens counted in the chunks' logprobs must match the usage, and
    the usage's prompt tokens `prompt_tokens`."""
    ttft = None
    usage = None
    streamed = 0
    start_s = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {response.status_code}: {text[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error in the stream: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                tokens = len((choice.get("logprobs") or {}).get("tokens") or [])
                if ttft is None and (tokens or choice.get("text")):
                    ttft = time.perf_counter() - start_s
                streamed += tokens
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
                if chunk["usage"]["prompt_tokens"] != prompt_tokens:
                    got = chunk["usage"]["prompt_tokens"]
                    raise RuntimeError(f"a prompt of {got} tokens, not {prompt_tokens}")
    if ttft is None or usage is None or usage != streamed:
        raise RuntimeError(f"a stream of {streamed} tokens: first at {ttft}, usage {usage}")
    return ttft, usage


async def load_async(
    url: str, batch: list[str], concurrency: int, args: argparse.Namespace
) -> tuple[list[float], float]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def one(prompt: str) -> tuple[float, int]:
            body = {
                "model": "model",
                "prompt": prompt,
                "max_tokens": args.output_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "logprobs": 0,  # a chunk for every token, text or not (see the docstring)
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with gate:
                return await stream_one(client, body, args.prompt_tokens)

        async with asyncio.timeout(LOAD_TIMEOUT_S):
            start_s = time.perf_counter()
            results = await asyncio.gather(*(one(p) for p in batch))
            elapsed = time.perf_counter() - start_s
    tokens = sum(t for _, t in results)
    if tokens != len(batch) * args.output_tokens:
        raise RuntimeError(f"{url}: {tokens} tokens, not {len(batch)} x {args.output_tokens}")
    return [ttft for ttft, _ in results], tokens / elapsed


def measure(name: str, url: str, loads: dict[int, list[str]], args: argparse.Namespace):
    """The warm-up load (key 0, at the top concurrency, unmeasured), then one load per
    concurrency: {concurrency: {"ttft_p50_ms", "tok_s"}}."""
    asyncio.run(load_async(url, loads[0], max(args.concurrency), args))
    out = {}
    for c in args.concurrency:
        ttfts, tok_s = asyncio.run(load_async(url, loads[c], c, args))
        out[c] = {"ttft_p50_ms": statistics.median(ttfts) * 1e3, "tok_s": tok_s}
        console.print(
            f"  {name} c={c}: TTFT p50 {out[c]['ttft_p50_ms']:.0f} ms, {tok_s:.1f} tok/s "
            f"({len(loads[c])} requests)"
        )
    return out


def topology(model: Path, args: argparse.Namespace, log_dir: Path, smg: str) -> dict[str, Any]:
    top = max(args.concurrency)
    loads = {  # the same prompts for both topologies; the warm-up (key 0) has others
        c: text_prompts(model, max(c or top, args.requests), args.prompt_tokens, seed=c or 10_000)
        for c in [0, *args.concurrency]
    }
    console.print("topology: one server (--num-threads 2)")
    with single_server(model, args, log_dir) as url:
        single = measure("single", url, loads, args)
    console.print("topology: prefill + decode (--num-threads 1 each) + smg")
    with pd_topology(model, args, log_dir, smg) as url:
        pd = measure("PD", url, loads, args)
    return {"single": single, "pd": pd}


def topology_table(
    result: dict[str, Any], args: argparse.Namespace, cpu: str
) -> tuple[Table, ResultTable]:
    """The printed table and the same as a result (numbers at the printed precision)."""
    table = Table(
        title=f"PD (prefill 1 thread + decode 1 thread + smg) vs one server (2 threads), {cpu}, "
        f"{args.prompt_tokens} prompt / {args.output_tokens} new tokens, streamed, C at a time; "
        "TTFT p50 in ms, output tok/s"
    )
    columns = ["C", "requests", "TTFT single", "TTFT PD", "PD/single"]
    for name in [*columns, "tok/s single", "tok/s PD", "PD/single "]:
        table.add_column(name, justify="right")
    recorded_columns = [*columns[:4], "TTFT PD/single", "tok/s single", "tok/s PD"]
    recorded = ResultTable(table.title or "", [*recorded_columns, "tok/s PD/single"], [])
    for c in args.concurrency:
        s, p = result["single"][c], result["pd"][c]
        recorded.rows.append(
            [
                c,
                max(c, args.requests),
                round(s["ttft_p50_ms"]),
                round(p["ttft_p50_ms"]),
                round(p["ttft_p50_ms"] / s["ttft_p50_ms"], 2),
                round(s["tok_s"], 1),
                round(p["tok_s"], 1),
                round(p["tok_s"] / s["tok_s"], 2),
            ]
        )
        table.add_row(
            str(c),
            str(max(c, args.requests)),
            f"{s['ttft_p50_ms']:.0f}",
            f"{p['ttft_p50_ms']:.0f}",
            f"{p['ttft_p50_ms'] / s['ttft_p50_ms']:.2f}x",
            f"{s['tok_s']:.1f}",
            f"{p['tok_s']:.1f}",
            f"{p['tok_s'] / s['tok_s']:.2f}x",
        )
    return table, recorded


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="a Hugging Face model directory (default: random)")
    p.add_argument("--kv-lengths", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--kv-dtypes", nargs="+", default=["bfloat16", "fp8_e4m3"])
    p.add_argument("--kv-repeats", type=int, default=5, help="handoffs per length (medians)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the KV part")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--requests", type=int, default=8, help="requests per load (at least C)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--startup-timeout", type=float, default=300.0, metavar="S")
    p.add_argument("--stop-grace", type=float, default=30.0, metavar="S")
    p.add_argument("--smg", help="the smg executable (default: beside this Python, then PATH)")
    p.add_argument("--log-dir", type=Path, help="children's logs (default: a temporary dir)")
    p.add_argument("--skip-kv", action="store_true", help="only the topology part")
    p.add_argument("--skip-topology", action="store_true", help="only the KV transfer part")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    args = p.parse_args()
    smg = args.smg or find_smg()
    if not args.skip_topology and smg is None:
        p.error("smg is not installed (pip install smg==1.13.0); or pass --skip-topology")
    cpu = cpu_name()
    t0 = time.perf_counter()
    result: dict[str, Any] = {"cpu": cpu, "args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        context = max([*args.kv_lengths, args.prompt_tokens]) + args.output_tokens
        model = args.model or random_model(Path(tmp), context)
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-pd-logs-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        console.print(f"CPU: {cpu}; logs: {log_dir}", highlight=False)
        tables: list[Table] = []
        recorded: list[ResultTable] = []
        if not args.skip_kv:
            result["kv_transfer"] = kv_transfer(model, args)
            table, as_result = kv_table(result["kv_transfer"], args, cpu)
            tables.append(table)
            recorded.append(as_result)
        if not args.skip_topology:
            try:
                result["topology"] = topology(model, args, log_dir, smg)
            except LaunchError as exc:
                console.print(f"[red]error:[/] {exc}; the last lines of {exc.child.log}:")
                console.print(exc.child.tail(), highlight=False, markup=False)
                raise SystemExit(1) from None
            table, as_result = topology_table(result["topology"], args, cpu)
            tables.append(table)
            recorded.append(as_result)
    result["elapsed_s"] = time.perf_counter() - t0
    wide = Console(stderr=True, width=max(console.width, 130))  # not squeezed to 80 in a pipe
    for table in tables:
        wide.print(table)
    console.print(f"run time {result['elapsed_s']:.0f} s")
    record(
        "bench_pd",
        "Prefill/decode disaggregation: the KV handoff's cost, and PD vs one server",
        recorded,
        notes=""
        if args.skip_topology
        else "On this machine PD's two engines share the cores the single server has to itself: "
        "the ratio is the split's overhead, not the capacity gain of separate machines.",
        threads=args.threads,
    )
    if args.json:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
