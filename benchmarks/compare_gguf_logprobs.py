"""The same GGUF file through llama-server and `thermostat serve`: next-token log-probabilities of
the same token-id prompts, side by side (does Thermostat read the file as llama.cpp does?).

    . /tmp/peers/venv/bin/activate     # ../shared/peers/setup.sh built llama.cpp and the GGUFs
    python benchmarks/compare_gguf_logprobs.py --thermostat .venv/bin/thermostat \\
        --gguf /tmp/peers/gguf/small-q8_0.gguf [--prompts 8] [--top 5]

For each prompt (random token ids, the same to both), one greedy token with its top-`top`
logprobs from each server (keyed by the token's text, which both report); reports whether the
greedy tokens agree and the largest difference between the two servers' logprobs of the tokens
both list.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

import httpx

PEERS_SCRIPTS = Path(
    os.environ.get("PEERS_SCRIPTS", Path(__file__).resolve().parents[2] / "shared" / "peers")
)
sys.path.insert(0, str(PEERS_SCRIPTS))
from bench_llamacpp import BIN_DIR  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_agreement import listed, start, stop  # noqa: E402
from results import Table, record  # noqa: E402


def llama_top(url: str, ids: list[int], top: int) -> dict[str, float]:
    body = {"prompt": ids, "n_predict": 1, "temperature": 0, "n_probs": top,
            "post_sampling_probs": False, "cache_prompt": False}  # fmt: skip
    r = httpx.post(f"{url}/completion", json=body, timeout=120).json()
    first = r["completion_probabilities"][0]
    return {t["token"]: float(t["logprob"]) for t in listed(first)}


def thermostat_top(url: str, ids: list[int], top: int) -> dict[str, float]:
    body = {"model": "model", "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": top}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    listed: dict[str, float] = r["choices"][0]["logprobs"]["top_logprobs"][0]  # text -> logprob
    return listed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--thermostat", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=49152)
    a = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, a.vocab) for _ in range(a.length)] for _ in range(a.prompts)]
    procs = []
    try:
        llama, llama_url, _ = start([os.path.join(BIN_DIR, "llama-server"), "-m", a.gguf, "-t",
                                  str(a.threads), "--host", "127.0.0.1", "--port", "{PORT}",
                                  "--no-webui"])  # fmt: skip
        procs.append(llama)
        ours, ours_url, _ = start([a.thermostat, "serve", "--model", a.gguf, "--port", "{PORT}",
                                "--served-model-name", "model", "--no-enable-prefix-caching"],
                               env=dict(os.environ, OMP_NUM_THREADS=str(a.threads)))  # fmt: skip
        procs.append(ours)
        same_greedy, worst = 0, 0.0
        per_prompt = Table(
            f"per prompt: one greedy token, top-{a.top} logprobs",
            ["prompt", "llama-server greedy", "thermostat greedy", "largest |dlogprob|"],
            [],
        )
        for i, ids in enumerate(prompts):
            theirs, mine = llama_top(llama_url, ids, a.top), thermostat_top(ours_url, ids, a.top)
            greedy = max(theirs, key=theirs.__getitem__), max(mine, key=mine.__getitem__)
            same_greedy += greedy[0] == greedy[1]
            common = set(theirs) & set(mine)
            diff = max((abs(theirs[t] - mine[t]) for t in common), default=float("nan"))
            worst = max(worst, diff)
            print(f"llama {sorted(theirs.items(), key=lambda kv: -kv[1])[:3]}")
            print(f"ours  {sorted(mine.items(), key=lambda kv: -kv[1])[:3]}  max |diff| {diff:.4f}")
            per_prompt.rows.append([i, greedy[0], greedy[1], round(diff, 4)])
        print(f"\n{a.gguf}: greedy token equal {same_greedy}/{len(prompts)}; largest logprob "
              f"difference over the top-{a.top} tokens both list: {worst:.4f} nats")  # fmt: skip
        summary = Table(
            f"{Path(a.gguf).name}: llama-server vs thermostat serve, {len(prompts)} prompts of "
            f"{a.length} random token ids",
            ["greedy token equal", "prompts", f"largest top-{a.top} logprob difference (nats)"],
            [[same_greedy, len(prompts), round(worst, 4)]],
        )
        record(
            "compare_gguf_logprobs",
            "The same GGUF file through llama-server and thermostat serve: next-token logprobs",
            [summary, per_prompt],
            threads=a.threads,
        )
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
