"""Quantized serving over HTTP, side by side in one interleaved run: llama-server on q8_0 and q4_0
GGUFs vs `thermostat serve` on the same random SmolLM2-135M-shaped weights in bf16, int8 and int4
(`--quantization`), same client, prompts and load (the peers' `client_load.run_load`).

    . /tmp/peers/venv/bin/activate     # ../shared/peers/setup.sh built llama.cpp and the models
    python benchmarks/bench_quantized_http.py --thermostat .venv/bin/thermostat [--reps 2]

The q4_0 GGUF is made once from the f16 one with llama.cpp's llama-quantize. For each concurrency
and rep every server runs one load in turn, so machine noise hits all alike; the table gives
medians and the ratios the issue asks for (int8 / q8_0, int4 / q4_0, int8 / bf16).

With `--gguf FILE` both serve that file instead (a real model: `thermostat serve --model
smollm2-135m-instruct`'s), Thermostat in the file's own formats, and the prompts are made of the
file's own tokens:

    GGUF=$(.venv/bin/python -c "from thermostat.engine.loader import resolve_model_path as r
    print(r('smollm2-135m-instruct'))")
    .venv/bin/python benchmarks/bench_quantized_http.py --thermostat .venv/bin/thermostat \
        --gguf "$GGUF"
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

PEERS_SCRIPTS = Path(
    os.environ.get("PEERS_SCRIPTS", Path(__file__).resolve().parents[2] / "shared" / "peers")
)
sys.path.insert(0, str(PEERS_SCRIPTS))
from bench_llamacpp import BIN_DIR, PEERS_DIR, free_port, gguf_path, wait_ready  # noqa: E402
from client_load import run_load  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import Table, record  # noqa: E402


def start(name: str, cmd: list[str], env: dict | None = None) -> dict:
    port = free_port()
    cmd = [c.replace("{PORT}", str(port)) for c in cmd]
    log = open(os.path.join(PEERS_DIR, "results", f"quant-{name}.log"), "w")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    print(f"[{name}] ready in {wait_ready(url, proc, timeout=300):.1f}s", flush=True)
    return {"name": name, "proc": proc, "url": url, "log": log}


def q4_0_gguf(model: str) -> str:
    path = gguf_path(model, "q4_0")
    if not os.path.exists(path):
        quantize = os.path.join(BIN_DIR, "llama-quantize")
        subprocess.run([quantize, gguf_path(model, "f16"), path, "q4_0"], check=True)
    return path


def gguf_tokenizer_json(gguf: str) -> str:
    """The file's own tokenizer as a tokenizer.json, which the load client makes prompts with."""
    from thermostat.models.gguf_reading import cached_tokenizer

    out = Path(PEERS_DIR) / "results" / f"{Path(gguf).stem}.tokenizer.json"
    cached_tokenizer(Path(gguf)).backend_tokenizer.save(str(out))
    return str(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--thermostat", required=True, help="path of the thermostat executable")
    ap.add_argument("--model", default="small")
    ap.add_argument("--conc", default="1,8,32")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--formats", default="bf16,int8,int4", help="Thermostat's weight formats")
    ap.add_argument("--types", default="q8_0,q4_0", help="llama-server's GGUF types")
    ap.add_argument("--gguf", help="serve this GGUF file with both servers, as the file stores it")
    a = ap.parse_args()
    concs = [int(c) for c in a.conc.split(",")]
    os.makedirs(os.path.join(PEERS_DIR, "results"), exist_ok=True)
    tok_json = os.path.join(PEERS_DIR, "models", f"{a.model}-fp32", "tokenizer.json")
    if a.gguf:
        tok_json, a.types, a.formats = gguf_tokenizer_json(a.gguf), "gguf", "gguf"
    servers = []
    per_slot = max(512, a.prompt_len + a.new_tokens + 64)  # llama-server splits -c among slots
    try:
        for t in a.types.split(","):
            model = a.gguf or (q4_0_gguf(a.model) if t == "q4_0" else gguf_path(a.model, t))
            servers.append(start(f"llama-{t}", [
                os.path.join(BIN_DIR, "llama-server"), "-m", model, "-t", str(a.threads),
                "-tb", str(a.threads), "-c", str(max(concs) * per_slot), "-np", str(max(concs)),
                "-b", "2048", "-ub", "512", "--host", "127.0.0.1", "--port", "{PORT}",
                "--no-webui"]))  # fmt: skip
            servers[-1]["extra"] = {"ignore_eos": True, "cache_prompt": False}
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
        for fmt in a.formats.split(","):
            quant = [] if fmt in ("bf16", "gguf") else ["--quantization", fmt]
            model = a.gguf or os.path.join(PEERS_DIR, "models", f"{a.model}-bf16")
            servers.append(start(f"thermostat-{fmt}", [
                a.thermostat, "serve", "--model", model, "--port", "{PORT}",
                "--served-model-name", "model", "--num-threads", str(a.threads),
                "--max-num-seqs", str(max(concs)), "--no-enable-prefix-caching", *quant],
                env=env))  # fmt: skip
            servers[-1]["extra"] = {"ignore_eos": True}
        for s in servers:  # warm-up
            warm = run_load(s["url"], 2, max_tokens=8, prompt_tokens=a.prompt_len,
                            tokenizer_json=tok_json, extra=s["extra"], max_seconds=120)  # fmt: skip
            asyncio.run(warm)
        rows: dict[tuple[str, int], list[float]] = {}
        for c in concs:
            waves = 3 if c == 1 else (2 if c <= 8 else 1)
            for rep in range(a.reps):
                for s in servers:
                    r = asyncio.run(run_load(
                        s["url"], c, waves=waves, max_tokens=a.new_tokens,
                        prompt_tokens=a.prompt_len, tokenizer_json=tok_json, extra=s["extra"],
                        stream=True, max_seconds=300))  # fmt: skip
                    rows.setdefault((s["name"], c), []).append(r["out_tok_s"])
                    line = f"c={c:<3} rep{rep} {s['name']:<18} {r['out_tok_s']:>8.1f} tok/s"
                    print(f"{line} err {r['errors']} ttft p50 {r['ttft_p50_ms']} ms", flush=True)
        med = {k: statistics.median(v) for k, v in rows.items()}
        print("\n| server | " + " | ".join(f"c={c}" for c in concs) + " |")
        print("|---|" + "---|" * len(concs))
        weights = Path(a.gguf).name if a.gguf else f"{a.model} model"
        table = Table(
            f"output tok/s, {weights}, {a.prompt_len} prompt / {a.new_tokens} new tokens, "
            f"streamed, medians of {a.reps}",
            ["server", *(f"c={c}" for c in concs)],
            [],
        )
        for s in servers:
            print(f"| {s['name']} | " + " | ".join(f"{med[(s['name'], c)]:.1f}" for c in concs)
                  + " |")  # fmt: skip
            table.rows.append([s["name"], *(round(med[(s["name"], c)], 1) for c in concs)])
        names = {s["name"] for s in servers}
        for ours, theirs in (("thermostat-int8", "llama-q8_0"), ("thermostat-int4", "llama-q4_0"),
                             ("thermostat-int8", "thermostat-bf16"),
                             ("thermostat-gguf", "llama-gguf")):  # fmt: skip
            if ours in names and theirs in names:
                print(f"| ratio {ours} / {theirs} | " + " | ".join(
                    f"{med[(ours, c)] / med[(theirs, c)]:.2f}x" for c in concs) + " |")  # fmt: skip
                table.rows.append(
                    [f"ratio {ours} / {theirs}",
                     *(round(med[(ours, c)] / med[(theirs, c)], 2) for c in concs)]
                )  # fmt: skip
        record(
            "bench_quantized_http_gguf" if a.gguf else "bench_quantized_http",
            f"A GGUF file over HTTP: llama-server and thermostat serve on {Path(a.gguf).name}"
            if a.gguf
            else "Quantized serving over HTTP: llama-server on q8_0/q4_0 GGUFs vs thermostat serve "
            "in bf16/int8/int4, same weights",
            [table],
            threads=a.threads,
        )
    finally:
        for s in servers:
            s["proc"].send_signal(signal.SIGINT)
            try:
                s["proc"].wait(timeout=20)
            except subprocess.TimeoutExpired:
                s["proc"].kill()
                s["proc"].wait()
            s["log"].close()


if __name__ == "__main__":
    main()
