"""Does Thermostat serve a GGUF file as llama.cpp does? The same file through llama-server and
`thermostat serve`, the same chat-templated prompts (token ids from llama-server's
/apply-template and /tokenize), greedy:
per prompt, whether the two generations agree token for token up to the first position where
llama-server's top-1 leads its runner-up by less than `--margin` nats (a near tie, where either
reading may flip it), and the largest difference between the two servers' logprobs of the top
tokens both list before that point. Also each server's ready time (process start to /health 200).

    GGUF=$(.venv/bin/python -c "from thermostat.engine.loader import resolve_model_path as r
    print(r('smollm2-135m-instruct'))")
    python benchmarks/gguf_agreement.py --thermostat .venv/bin/thermostat --gguf "$GGUF"

llama-server comes from ../shared/peers/setup.sh (LLAMA_BIN_DIR, default
/tmp/peers/llama-build/bin).
Prints a line per prompt and the totals, and records them (benchmarks/results.py:
`benchmarks/results/gguf_agreement.json`).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

PEERS_SCRIPTS = Path(
    os.environ.get("PEERS_SCRIPTS", Path(__file__).resolve().parents[2] / "shared" / "peers")
)
sys.path.insert(0, str(PEERS_SCRIPTS))
from bench_llamacpp import BIN_DIR, free_port, wait_ready  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import Table, record, show  # noqa: E402

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash map is in two sentences.",
    "Write an HTML page with a form that has a name field and a submit button.",
    "What is the capital of France?",
    "List three uses of a for loop.",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "Give me a JSON object describing a book with a title and an author.",
    "What does the CSS property display: flex do?",
    "Write a SQL query that counts the rows of a table named users.",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "Write a bash command that lists the files of a directory by size.",
    "What is the difference between a list and a tuple in Python?",
    "Write a short email asking a colleague for a meeting.",
    "Name three planets of the solar system.",
    "Write a JavaScript function that adds two numbers.",
]


def start(cmd: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str, float]:
    """The server, its URL and its ready time (process start to a 200 from /health)."""
    port = free_port()
    cmd = [c.replace("{PORT}", str(port)) for c in cmd]
    began = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, timeout=600)
    return proc, url, time.monotonic() - began


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGINT each server, SIGKILL one that has not exited 20 s later."""
    for p in procs:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


def llama_positions(url: str, ids: list[int], n: int, top: int) -> list[dict]:
    """llama-server's generated positions as it lists them: token, id, logprob, top_logprobs."""
    body = {"prompt": ids, "n_predict": n, "temperature": 0, "n_probs": top,
            "post_sampling_probs": False, "cache_prompt": False}  # fmt: skip
    r = httpx.post(f"{url}/completion", json=body, timeout=600).json()
    return list(r["completion_probabilities"])


def listed(position: dict) -> list[dict]:
    """A position's top tokens as llama-server lists them (the key differs across versions)."""
    return list(position.get("top_logprobs") or position.get("probs") or [])


def ranked(positions: list[dict]) -> list[dict[str, float]]:
    """Per position: {token text: logprob} of the listed top tokens, the chosen token first."""
    out = []
    for position in positions:
        top = {t["token"]: float(t["logprob"]) for t in listed(position)}
        out.append({position["token"]: top.get(position["token"], 0.0)} | top)
    return out


def token_ids(positions: list[dict]) -> list[dict[str, int]]:
    """Per position: {token text: id} of the chosen and listed tokens."""
    return [
        {position["token"]: position["id"]} | {t["token"]: t["id"] for t in listed(position)}
        for position in positions
    ]


def llama_run(url: str, ids: list[int], n: int, top: int) -> list[dict[str, float]]:
    return ranked(llama_positions(url, ids, n, top))


def prompt_ids(url: str, messages: list[dict]) -> list[int]:
    """llama-server's token ids for the chat: the file's template applied, special tokens read."""
    text = httpx.post(f"{url}/apply-template", json={"messages": messages}, timeout=60).json()
    body = {"content": text["prompt"], "add_special": False, "parse_special": True}
    return list(httpx.post(f"{url}/tokenize", json=body, timeout=60).json()["tokens"])


def thermostat_run(url: str, ids: list[int], n: int, top: int) -> list[dict[str, float]]:
    body = {"model": "model", "prompt": ids, "max_tokens": n, "temperature": 0, "logprobs": top}
    logprobs = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()["choices"][0][
        "logprobs"
    ]
    return [
        {token: chosen} | dict(ranked)
        for token, chosen, ranked in zip(
            logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
        )
    ]


def compare(theirs: list[dict[str, float]], mine: list[dict[str, float]], margin: float):
    """(tokens compared, whether they agree up to there, worst shared-logprob difference)."""
    worst = 0.0
    for i, (t, m) in enumerate(zip(theirs, mine, strict=False)):
        ranked = sorted(t.values(), reverse=True)
        if len(ranked) > 1 and ranked[0] - ranked[1] < margin:
            return i, True, worst  # a near tie: compared up to here
        if next(iter(t)) != next(iter(m)):
            return i, False, worst
        shared = set(t) & set(m)
        worst = max([worst, *(abs(t[k] - m[k]) for k in shared)])
    return min(len(theirs), len(mine)), len(theirs) == len(mine), worst


def exact_distances(gguf: str, runs: list[dict]) -> dict[str, list[float]]:
    """|logprob - exact logprob| of llama-server and the second server, over the tokens both list
    at each compared position. Exact: transformers' float32 forward over the file's weights
    dequantized (no activation quantization, float32 attention and KV), teacher-forced on
    llama-server's tokens: how far each server's arithmetic is from the file's own values."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    out: dict[str, list[float]] = {"llama-server": [], "second": []}
    for run in runs:
        ids, positions = run["ids"], run["positions"]
        with torch.no_grad():
            logits = model(torch.tensor([ids + [p["id"] for p in positions]])).logits[0]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        for i, names in enumerate(token_ids(positions)[: run["compared"]]):
            theirs, mine = run["theirs"][i], run["mine"][i]
            for text, token in names.items():
                if text in theirs and text in mine:
                    exact = logprobs[len(ids) - 1 + i, token].item()
                    out["llama-server"].append(abs(theirs[text] - exact))
                    out["second"].append(abs(mine[text] - exact))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--thermostat", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--extra", default="", help="more flags for the second server")
    ap.add_argument(
        "--versus",
        choices=["thermostat", "llama-server"],
        default="thermostat",
        help="the second server: thermostat, or llama-server itself with --extra's flags "
        "(its own agreement across its settings: the noise floor of this measure)",
    )
    ap.add_argument(
        "--exact",
        action="store_true",
        help="also each server's distance to the file's exact values (transformers, float32, "
        "the weights dequantized): the noise each server's own arithmetic adds",
    )
    a = ap.parse_args()
    procs = []
    try:
        llama, llama_url, llama_ready = start([
            os.path.join(BIN_DIR, "llama-server"), "-m", a.gguf, "-t", str(a.threads),
            "--host", "127.0.0.1", "--port", "{PORT}", "--no-webui", "-c", "4096",
        ])  # fmt: skip
        procs.append(llama)
        if a.versus == "llama-server":
            ours, ours_url, ours_ready = start([
                os.path.join(BIN_DIR, "llama-server"), "-m", a.gguf, "-t", str(a.threads),
                "--host", "127.0.0.1", "--port", "{PORT}", "--no-webui", "-c", "4096",
                *a.extra.split(),
            ])  # fmt: skip
        else:
            ours, ours_url, ours_ready = start(
                [a.thermostat, "serve", "--model", a.gguf, "--port", "{PORT}",
                 "--served-model-name", "model", "--no-enable-prefix-caching", *a.extra.split()],
                env=dict(os.environ, OMP_NUM_THREADS=str(a.threads)),
            )  # fmt: skip
        procs.append(ours)
        second = llama_run if a.versus == "llama-server" else thermostat_run
        rows = []
        for text in PROMPTS:
            messages = [{"role": "user", "content": text}]
            ids = prompt_ids(llama_url, messages)
            positions = llama_positions(llama_url, ids, a.tokens, a.top)
            theirs = ranked(positions)
            mine = second(ours_url, ids, a.tokens, a.top)
            compared, agree, worst = compare(theirs, mine, a.margin)
            rows.append({
                "prompt": text, "compared": compared, "agree": agree, "worst": worst,
                "ids": ids, "positions": positions, "theirs": theirs, "mine": mine,
            })  # fmt: skip
            print(f"{'same' if agree else 'DIFF'}  {compared:3d} tokens  max |dlogprob| "
                  f"{worst:.4f}  {text[:50]}")  # fmt: skip
        agree, worst = sum(r["agree"] for r in rows), max(r["worst"] for r in rows)
        print(f"\nagree {agree}/{len(rows)}; largest shared top-{a.top} logprob "
              f"difference {worst:.4f} nats; ready: llama-server "
              f"{llama_ready:.1f} s, {a.versus} {a.extra} {ours_ready:.1f} s")  # fmt: skip
        summary = Table(
            f"{Path(a.gguf).name}: llama-server vs {a.versus} {a.extra}".strip(),
            ["second server", "flags", "prompts agreeing", "prompts",
             f"largest shared top-{a.top} logprob difference (nats)",
             "ready llama-server (s)", "ready second (s)"],
            [[a.versus, a.extra, agree, len(rows), round(worst, 4), round(llama_ready, 2),
              round(ours_ready, 2)]],
        )  # fmt: skip
        per_prompt = Table(
            f"per prompt: {a.tokens} greedy tokens, compared up to the first near tie "
            f"({a.margin} nats) of llama-server's top two",
            ["prompt", "tokens compared", "agree", "largest |dlogprob|"],
            [[r["prompt"], r["compared"], "same" if r["agree"] else "DIFF", round(r["worst"], 4)]
             for r in rows],
        )  # fmt: skip
        tables = [summary, per_prompt]
    finally:
        stop(procs)
    if a.exact:
        distances = exact_distances(a.gguf, rows)
        table = Table(
            "distance to the exact values (transformers, float32, the file's weights dequantized, "
            "teacher-forced on llama-server's tokens), over the tokens both servers list at each "
            "compared position",
            ["server", "logprobs", "median |d| (nats)", "90th percentile", "largest"],
            [[name if name == "llama-server" else f"{a.versus} {a.extra}".strip(), len(d),
              round(statistics.median(d), 4), round(sorted(d)[int(0.9 * (len(d) - 1))], 4),
              round(max(d), 4)] for name, d in distances.items()],
        )  # fmt: skip
        show(table)
        tables.append(table)
    record(
        "gguf_agreement",
        "Does Thermostat serve a GGUF file as llama.cpp does? The same file through "
        "llama-server and a second server, greedy",
        tables,
        threads=a.threads,
    )


if __name__ == "__main__":
    main()
