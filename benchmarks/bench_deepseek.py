"""Output tokens/s of a DeepSeek-V3-shaped model (MLA + MoE), or with `--family v4` a
DeepSeek-V4-shaped one (hyper-connections, CSA/HCA compressed attention, MoE): Thermostat with a
bfloat16 and an fp8_e4m3 cache vs transformers `generate`, same random bfloat16 weights, in one
run.

    .venv/bin/python benchmarks/bench_deepseek.py [--family v3|v4] [--batches 1 32]
        [--repeats 3] [--json]

(--json: the results as JSON on stdout, the table on stderr.)

The model (DEEPSEEK_V3_SMALL, about 160M parameters, 320 MB in bfloat16) keeps V3's layout at
a size this machine holds: q LoRA, a 256 + 32 latent, 16 routed experts top-4 in 4 groups with
one shared expert, sigmoid router with its bias, the first layer dense. Each batch size submits
N requests of 128 random prompt tokens at once and generates 64 new tokens each (greedy, no
early stop). The three engines run alternately `--repeats` times; the table reports medians and
the KV bytes each stores per token: measured on transformers' cache after a forward pass (5.x
caches the latent too, in a contiguous tensor per sequence, and re-expands it to per-head keys and
values every step), and Thermostat's paged cache spec (the latent and rope key, plus one float32
scale per token and layer under fp8).

The V4 model (DEEPSEEK_V4_SMALL) keeps V4-Flash's layer mix (two sliding-only layers, then CSA
and HCA alternating), its rates (4 and 128), window (128), top-k (512), 4 hyper-connection
streams and a hash-routed first layer, at hidden 1024 with 256-dim heads. Its KV column is
Thermostat's cache per token of context (every component at its rate: window rows and
compressor state included while they are stored per token); transformers' V4 cache keeps the
window, entries and compressor buffers in per-layer tensors of its own (not measured).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from results import Table as ResultTable
from results import record
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from thermostat import LLM, SamplingParams, kernels
from thermostat.random_model import write_model

console = Console(stderr=True)

DEEPSEEK_V3_SMALL = dict(
    vocab_size=16384,
    hidden_size=1024,
    intermediate_size=2816,  # the dense first layer
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=384,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    moe_intermediate_size=256,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    max_position_embeddings=4096,
    rope_parameters={  # V3's YaRN, at a 4x factor
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    initializer_range=0.02,
    tie_word_embeddings=False,
)
_S, _C, _H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
DEEPSEEK_V4_SMALL = dict(
    vocab_size=16384,
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    head_dim=256,
    partial_rotary_factor=0.25,
    q_lora_rank=384,
    o_groups=4,
    o_lora_rank=256,
    sliding_window=128,
    layer_types=[_S, _S, _C, _H, _C, _H, _C, _H],
    compress_rates={_C: 4, _H: 128},
    index_n_heads=8,
    index_head_dim=64,
    index_topk=512,
    n_routed_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
    hc_mult=4,
    num_hash_layers=1,
    max_position_embeddings=4096,
    initializer_range=0.02,
    tie_word_embeddings=False,
)
FAMILIES = {  # --family: random_model kind, shape, what its cache holds
    "v3": ("deepseek_v3", DEEPSEEK_V3_SMALL, "latent"),
    "v4": ("deepseek_v4", DEEPSEEK_V4_SMALL, "KV"),
}
KV_LAYOUTS = {"bf16": "bfloat16", "fp8": "fp8_e4m3"}  # Thermostat's --kv-cache-dtype per column


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (batch, length), generator=gen).tolist()


def run_thermostat(llm: LLM, batch: int, args, seed: int) -> float:
    """Output tokens/s of one group of `batch` requests, from submission to the last token."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    group = prompts(batch, args.prompt_tokens, args.vocab, seed)
    engine.add_group(f"bench-{seed}-{batch}", engine.plan(group, params))
    start, produced = time.perf_counter(), 0
    while engine.has_unfinished():
        produced += sum(len(out.new_token_ids) for out in engine.step())
    assert produced == batch * args.output_tokens
    return produced / (time.perf_counter() - start)


@torch.inference_mode()
def run_transformers(model, batch: int, args, seed: int) -> float:
    ids = torch.tensor(prompts(batch, args.prompt_tokens, args.vocab, seed))
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        pad_token_id=0,
        max_new_tokens=args.output_tokens,
        min_new_tokens=args.output_tokens,
    )
    return (out.shape[1] - ids.shape[1]) * batch / (time.perf_counter() - start)


@torch.inference_mode()
def transformers_kv_bytes_per_token(model, tokens: int = 8) -> int | None:
    if model.config.model_type == "deepseek_v4":
        return None  # its own cache layers (window, entries, buffers): not comparable per token
    out = model(torch.arange(100, 100 + tokens)[None], use_cache=True)
    cache = out.cache
    total = sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
    )
    return total // tokens


def thermostat_kv_bytes_per_token(llm: LLM) -> int:
    spec = llm.engine.cache.spec
    return spec.bytes_per_block // spec.block_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="v3")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per batch size")
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a written model")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    kind, shape, holds = FAMILIES[args.family]
    args.vocab = shape["vocab_size"]

    load_before = os.getloadavg()[0]
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="thermostat-bench-ds-"))
    if not (model_dir / "config.json").is_file():
        console.log(f"writing a random {kind}-shaped model to {model_dir}")
        write_model(model_dir, kind, dtype=torch.bfloat16, **shape)
    weight_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    engines = {
        name: LLM(
            str(model_dir),
            dtype="bfloat16",
            kv_cache_dtype=kv,
            enable_prefix_caching=False,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
        )
        for name, kv in KV_LAYOUTS.items()
    }
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    kv_bytes = {name: thermostat_kv_bytes_per_token(llm) for name, llm in engines.items()}
    kv_bytes["transformers"] = transformers_kv_bytes_per_token(hf)
    warm = argparse.Namespace(prompt_tokens=16, output_tokens=4, vocab=args.vocab)
    for llm in engines.values():
        run_thermostat(llm, 2, warm, seed=0)
    run_transformers(hf, 2, warm, seed=0)

    runs: dict[int, dict[str, list[float]]] = {}
    for batch in args.batches:
        runs[batch] = {name: [] for name in [*engines, "transformers"]}
        for rep in range(args.repeats):
            seed = 1 + rep
            for name, llm in engines.items():
                console.log(f"batch {batch}, run {rep + 1}/{args.repeats}: thermostat {name} KV")
                runs[batch][name].append(run_thermostat(llm, batch, args, seed))
            console.log(f"batch {batch}, run {rep + 1}/{args.repeats}: transformers")
            runs[batch]["transformers"].append(run_transformers(hf, batch, args, seed))

    result = {
        "family": args.family,
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "cpu_kernels": kernels.status(),
        "repeats": args.repeats,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes,
        "tok_s": {
            batch: {name: statistics.median(v) for name, v in by_name.items()}
            for batch, by_name in runs.items()
        },
        "runs": runs,
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
    }
    table = Table(
        title=f"{kind}-shaped, {weight_bytes / 1e6:.0f} MB bf16 weights, {result['cpu']}, "
        f"{result['threads']} threads; output tok/s, medians of {args.repeats} alternating runs, "
        f"{args.prompt_tokens} prompt + {args.output_tokens} new tokens per sequence; "
        "cells: median, x transformers, (range of runs)"
    )
    table.add_column("engine, KV cache")
    table.add_column("KV bytes/token", justify="right")
    for batch in args.batches:
        table.add_column(f"{batch} seq", justify="right")
    recorded = ResultTable(
        str(table.title).replace(
            "cells: median, x transformers, (range of runs)",
            "per batch: the median, x transformers, the runs' minimum and maximum",
        ),
        ["engine, KV cache", "KV bytes/token"]
        + [
            f"{b} seq {what}"
            for b in args.batches
            for what in ("tok/s", "x transformers", "min", "max")
        ],
        [],
    )
    labels = {
        "bf16": f"Thermostat, bf16 {holds}",
        "fp8": f"Thermostat, fp8 {holds}",
        "transformers": f"transformers generate, bf16 {holds}",
    }
    for name, label in labels.items():
        cells = []
        kv = kv_bytes[name]
        row: list[str | float | int | None] = [label, kv]
        for batch in args.batches:
            tok_s, spread = result["tok_s"][batch], runs[batch][name]
            ratio = None if name == "transformers" else tok_s[name] / tok_s["transformers"]
            vs_hf = "" if ratio is None else f" {ratio:.1f}x"
            cells.append(f"{tok_s[name]:.1f}{vs_hf} ({min(spread):.1f}-{max(spread):.1f})")
            row += [
                round(tok_s[name], 1),
                None if ratio is None else round(ratio, 2),
                round(min(spread), 1),
                round(max(spread), 1),
            ]
        table.add_row(label, "-" if kv is None else f"{kv:,}", *cells)
        recorded.rows.append(row)
    load = result["load_average_1min"]
    out = console if args.json else Console()  # with --json, the table goes to stderr
    out.print(table)
    load_note = f"1-minute load average: {load['before']:.2f} before, {load['after']:.2f} after"
    out.print(load_note)
    record(
        f"bench_deepseek_{args.family}",
        f"Output tok/s of a DeepSeek-{args.family.upper()}-shaped model: Thermostat (bf16 and "
        "fp8 KV cache) vs transformers generate, same random weights",
        [recorded],
        notes=load_note + ".",
        threads=result["threads"],
    )
    if args.json:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
