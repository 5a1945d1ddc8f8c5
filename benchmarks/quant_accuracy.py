"""Accuracy of the integer weight formats against the model's own dtype: top-1 agreement and
mean KL divergence of the next-token distributions over a few hundred positions, and how many
greedy continuations are equal, on the demo model and random SmolLM2-135M-shaped weights.

    .venv/bin/python benchmarks/quant_accuracy.py [--positions 400] [--prompts 16]

Positions come from teacher-forced text (the demo's training text for the demo model, token ids
of the same text through the SmolLM-shaped model's tokenizer); every format sees the same tokens.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from results import Table as ResultTable
from results import record
from rich.console import Console
from rich.table import Table

from thermostat import LLM, SamplingParams
from thermostat.models.attention import AttentionMetadata, PrefillSegment
from thermostat.random_model import SMOLLM2_135M, TEXT, write_model

PROMPTS = [
    "To be, or not to be", "The king said", "Once upon a time", "O Romeo, Romeo",
    "Friends, Romans, countrymen", "All the world's a stage", "Now is the winter",
    "What light through yonder", "Good night, good night", "Is this a dagger",
    "Double, double toil", "If music be the food", "The quality of mercy",
    "Shall I compare thee", "A horse! a horse!", "Cowards die many times",
]  # fmt: skip


@torch.inference_mode()
def full_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Next-token logits [len, vocab] float32 of one fresh sequence, in one prefill."""
    engine = llm.engine
    cache, block = engine.cache, engine.config.block_size
    n = len(ids)
    blocks = torch.arange((n + block - 1) // block, dtype=torch.int64)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64),
        num_decodes=0,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int64),
        decode_context_lens=torch.zeros(0, dtype=torch.int64),
        decode_mask=torch.zeros(0, 1, 1, block, dtype=torch.bool),
        prefills=[PrefillSegment(n, n, blocks[None], None)],
    )
    model = engine.loaded.model
    hidden = model(torch.tensor(ids), torch.arange(n), meta, cache)
    return model.compute_logits(hidden)


def compare(model: str, text_ids: list[int], formats: list[str], prompts: list[str], console):
    ref = LLM(model, enable_prefix_caching=False)
    base = full_logits(ref, text_ids).log_softmax(-1)
    greedy = SamplingParams(temperature=0, max_tokens=32)
    base_out = [o.token_ids for o in ref.generate(prompts, greedy)]
    base_bytes = ref.engine.loaded.weight_bytes
    del ref
    rows = []
    for fmt in formats:
        llm = LLM(model, quantization=fmt, enable_prefix_caching=False)
        got = full_logits(llm, text_ids).log_softmax(-1)
        agree = (got.argmax(-1) == base.argmax(-1)).float().mean().item()
        kl = (base.exp() * (base - got)).sum(-1).mean().item()
        outs = [o.token_ids for o in llm.generate(prompts, greedy)]
        equal = sum(a == b for a, b in zip(outs, base_out, strict=True))
        ratio = llm.engine.loaded.weight_bytes / base_bytes
        rows.append((fmt, agree, kl, equal, ratio))
        console.log(f"{model} {fmt}: top-1 {agree:.3f}, KL {kl:.4f}, greedy equal {equal}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--positions", type=int, default=400)
    ap.add_argument("--prompts", type=int, default=16)
    args = ap.parse_args()
    console = Console(stderr=True)
    table = Table(title=f"integer weights vs the model's dtype ({args.positions} positions)")
    for col in ("model", "format", "top-1 agreement", "mean KL (nats)", "greedy equal",
                "weight bytes vs bf16"):  # fmt: skip
        table.add_column(col)
    prompts = PROMPTS[: args.prompts]
    columns = ["model", "format", "top-1 agreement", "mean KL (nats)",
               f"greedy equal (of {len(prompts)})", "weight bytes vs bf16"]  # fmt: skip
    recorded = ResultTable(table.title or "", columns, [])
    with tempfile.TemporaryDirectory() as tmp:
        smol = Path(tmp) / "smollm2-135m-shape"
        console.log("writing a random SmolLM2-135M-shaped model (bf16)")
        write_model(smol, "llama", dtype=torch.bfloat16, **SMOLLM2_135M)
        for name, model in (("demo", "demo"), ("SmolLM2-135M shape", str(smol))):
            tokenizer = LLM(model).tokenizer
            ids = tokenizer.encode(TEXT * 20)[: args.positions]
            for fmt, agree, kl, equal, ratio in compare(
                model, ids, ["int8", "int4"], prompts, console
            ):
                table.add_row(name, fmt, f"{agree:.3f}", f"{kl:.4f}", f"{equal}/{len(prompts)}",
                              f"{ratio:.2f}x")  # fmt: skip
                recorded.rows.append(
                    [name, fmt, round(agree, 3), round(kl, 4), equal, round(ratio, 2)]
                )
    Console().print(table)
    record(
        "quant_accuracy",
        "Accuracy of the integer weight formats against the model's own dtype",
        [recorded],
        notes=f"Greedy continuations of 32 tokens from {len(prompts)} prompts; positions "
        "teacher-forced from the demo's training text.",
    )


if __name__ == "__main__":
    main()
