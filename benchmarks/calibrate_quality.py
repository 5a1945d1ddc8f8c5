"""Calibrate the degeneration detectors: false positives on healthy text, detection of loops.

    .venv/bin/python benchmarks/calibrate_quality.py [--chunks 3000] [--seed 0] [--json]

Healthy text is whatever this machine has: licences (/usr/share/common-licenses), Debian
copyright files, the docstrings of the stdlib, `import this`, stdlib Python source, C headers
(/usr/include), HTML documentation on disk (/usr/share/doc, Python installs, a sample of the
Rust docs) and generated valid pages. Every document is cut into consecutive chunks of 200-1500
characters at random positions (a generation stops anywhere), at most --chunks per corpus;
HTML pages are also checked whole. Degenerate text is built from the same healthy text: loops
of 1..40 tokens repeated 3..20 times at the end of a healthy prefix (cut off mid-cycle half of
the time), character loops, symbol and number runs, "the the the", numbered lists that repeat
their content, pages with pasted duplicate blocks, renamed ids, dropped end tags; plus real
greedy generations from /tmp/greedy_samples.json (a JSON list of strings) when that file exists.

Prints the false-positive rate per healthy corpus, the detection rate per degenerate kind, the
extremes of each signal on healthy text (what the thresholds in `DetectorConfig` are read from),
and the cost per call. --json prints the same numbers as JSON on stdout.

Result (seed 0, --chunks 3000, DEFAULT config): 0 of 18,284 healthy chunks flagged (299
licence, 3000 each of copyright files, docstrings, Python source, C headers, HTML on disk,
2585 generated HTML) and 0 of 400 whole generated pages; token loops covering >= 40 tokens
98.8% (the misses are cycles of numbers and punctuation only, left to the character view),
every other degenerate kind 100%. Whole pages on disk are flagged 31 of 542 times, each a real
error in the installed page (checked by hand): mdbook's `aria-describedby="searchresults-header"`
whose element is `id="mdbook-searchresults-header"` (24 pages), duplicate ids in Node.js and
Sphinx docs, `<h5>...</h3>` in nettle.html, a stray `</li>` in gcc's NEWS.html.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from results import Table as ResultTable
from results import record
from rich.console import Console
from rich.table import Table

from thermostat.quality import DEFAULT, QualityReport, StreamingAnalyzer, measure
from thermostat.quality.loops import is_language
from thermostat.quality.verdict import Measurements, judge

console = Console(stderr=True, width=150)
STDLIB = Path(os.__file__).parent
RUST_DOCS = Path.home() / ".rustup/toolchains/stable-x86_64-unknown-linux-gnu/share/doc/rust/html"
GREEDY_SAMPLES = Path("/tmp/greedy_samples.json")
WORDS_RE = re.compile(r"[A-Za-z]{3,}")


# ---------------------------------------------------------------- healthy text on this machine


def read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def unique_texts(paths: Iterator[Path], min_chars: int = 200) -> list[str]:
    seen: dict[str, None] = {}
    for path in paths:
        text = read(path)
        if text and len(text) >= min_chars:
            seen.setdefault(text, None)
        # identical files (symlinked licences, copied copyright files) count once
    return list(seen)


def stdlib_sources() -> list[Path]:
    skip = ("test", "tests", "idle_test", "site-packages")  # tests hold deliberate junk
    return sorted(
        p for p in STDLIB.rglob("*.py") if not any(part in skip for part in p.parts[-4:-1])
    )


def docstrings(paths: list[Path]) -> list[str]:
    out = []
    for path in paths:
        try:
            tree = ast.parse(read(path) or "")
        except (SyntaxError, ValueError):
            continue
        nodes = (n for n in ast.walk(tree) if isinstance(n, ast.Module | ast.ClassDef))
        nodes = [*nodes, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))]
        out.extend(d for n in nodes if (d := ast.get_docstring(n)) and len(d) >= 200)
    return out


def zen() -> str:
    buf = io.StringIO()
    with redirect_stdout(buf):
        import this  # prints the Zen of Python on first import
    return buf.getvalue() or "".join(this.d.get(c, c) for c in this.s)  # already imported


def html_files(rng: random.Random, rust_sample: int) -> list[Path]:
    roots = [Path("/usr/share/doc"), STDLIB.parent, Path(sys.prefix)]
    found = {p.resolve() for root in roots if root.exists() for p in root.rglob("*.html")}
    if RUST_DOCS.exists():
        rust = sorted(RUST_DOCS.rglob("*.html"))
        found |= set(rng.sample(rust, min(rust_sample, len(rust))))
    return sorted(found)


# ---------------------------------------------------------------- generated HTML pages


@dataclass
class Page:
    """A generated page as parts, so that degenerate variants can change one thing."""

    head: str
    nav: str
    sections: list[str]
    form: str
    script: str
    ids: list[str] = field(default_factory=list)

    def html(self, sections: list[str] | None = None, script: str | None = None) -> str:
        body = "\n".join(sections if sections is not None else self.sections)
        return (
            f'<!DOCTYPE html>\n<html lang="en">\n{self.head}\n<body>\n{self.nav}\n'
            f'<main id="main">\n{body}\n{self.form}\n</main>\n'
            f'<footer><p><a href="#top">Back to top</a></p></footer>\n'
            f"{self.script if script is None else script}\n</body>\n</html>\n"
        )


def sentence(rng: random.Random, words: list[str]) -> str:
    return " ".join(rng.choice(words) for _ in range(rng.randint(6, 18))).capitalize() + "."


def generate_page(rng: random.Random, words: list[str]) -> Page:
    slug = lambda: "-".join(rng.choice(words).lower() for _ in range(2))  # noqa: E731
    n = rng.randint(2, 6)
    sec_ids = list(dict.fromkeys(f"sec-{slug()}" for _ in range(n)))
    title = sentence(rng, words)[:40]
    head = f'<head>\n<meta charset="utf-8">\n<title>{title}</title>\n</head>'
    links = "".join(f'<li><a href="#{i}">{i[4:]}</a></li>' for i in sec_ids)
    nav = f'<nav id="nav" aria-label="Contents"><ul>{links}</ul></nav>'
    sections = []
    for i in sec_ids:
        paras = "\n".join(f"<p>{sentence(rng, words)} {sentence(rng, words)}</p>" for _ in "ab")
        items = "".join(f"<li>{sentence(rng, words)}" for _ in range(rng.randint(1, 4)))
        omit = rng.random() < 0.5  # end tags of <li> are optional in HTML
        items = items if omit else items.replace("<li>", "</li><li>")[5:] + "</li>"
        sections.append(
            f'<section id="{i}" aria-labelledby="{i}-h">\n<h2 id="{i}-h">{i[4:]}</h2>\n'
            f"{paras}\n<ul>{items}</ul>\n"
            f'<table><tr><th id="{i}-k">Key</th><th id="{i}-v">Value</th></tr>'
            f'<tr><td headers="{i}-k">{rng.choice(words)}</td>'
            f'<td headers="{i}-v">{rng.randint(0, 999)}</td></tr></table>\n</section>'
        )
    form = (
        '<form id="contact">\n<label for="email">Email</label>\n'
        '<input id="email" type="email" aria-describedby="email-hint">\n'
        '<p id="email-hint">We never share it.</p>\n<button type="submit">Send</button>\n'
        "</form>"
    )
    script = (
        '<script>\nconst form = document.getElementById("contact");\n'
        "form.addEventListener('submit', (e) => { e.preventDefault(); "
        "document.querySelector('#email').focus(); });\n</script>"
    )
    ids = ["nav", "main", "contact", "email", "email-hint"]
    return Page(head, nav, sections, form, script, ids + sec_ids)


# ---------------------------------------------------------------- chunking and degeneration


def chunks(text: str, rng: random.Random, lo: int = 200, hi: int = 1500) -> Iterator[str]:
    """Consecutive pieces of lo..hi characters, cut anywhere (a generation stops anywhere)."""
    start = 0
    while len(text) - start >= lo:
        end = start + rng.randint(lo, hi)
        yield text[start:end]
        start = end


def chunked(docs: list[str], rng: random.Random, limit: int) -> list[str]:
    pieces = [c for d in docs for c in chunks(d, rng)]
    return rng.sample(pieces, limit) if len(pieces) > limit else pieces


def token_unit(rng: random.Random, prose: list[str], period: int) -> str:
    """The original text of `period` consecutive tokens of one of `prose`, then a space (a
    document of fewer tokens is passed over)."""
    spans: list[tuple[int, int]] = []
    while len(spans) <= period:
        source = rng.choice(prose)
        spans = [m.span() for m in re.finditer(r"\w+|[^\w\s]", source)]
    i = rng.randrange(0, len(spans) - period)
    return source[spans[i][0] : spans[i + period - 1][1]] + " "


@dataclass(frozen=True)
class Case:
    kind: str
    text: str
    expect: bool = True  # counted in the detection target


def loop_cases(rng: random.Random, prose: list[str], n: int) -> Iterator[Case]:
    """Healthy prefix + a token cycle of period 1..40 repeated 3..20 times, cut off mid-cycle
    half of the time. In the target when it covers >= 40 tokens."""
    for _ in range(n):
        source = rng.choice(prose)
        prefix = next(chunks(source, rng, 100, 800), source[:400])
        period, repeats = rng.randint(1, 40), rng.randint(3, 20)
        unit = token_unit(rng, prose, period)
        loop = unit * repeats
        if rng.random() < 0.5:
            loop += unit[: rng.randrange(1, len(unit))]
        covered = period * repeats
        kind = "token loop, >= 40 tokens" if covered >= 40 else "token loop, < 40 tokens"
        yield Case(kind, prefix + " " + loop, expect=covered >= 40)


CHAR_UNITS = ["a", "ha", "ab", "xyz", "的", "ok", "<p>a", "0x", "abc123", "Lo", "$a", "é"]
SYMBOL_UNITS = ["!", "=", "-=", "*", "..", "\n", "#", "~", "|-", "})", "\n\n", "  ", "?!", "<div>"]
NUMBER_UNITS = ["0, ", "1", "0.", "12 ", "1 2 3 ", "00", "_0", "-1,\n"]


def char_cases(rng: random.Random, prose: list[str], n: int) -> Iterator[Case]:
    for _ in range(n):
        prefix = next(chunks(rng.choice(prose), rng, 100, 800))
        unit = rng.choice(CHAR_UNITS)  # repeated to cover at least the drawn length
        loop = unit * -(-rng.randint(48, 400) // len(unit))
        yield Case("char loop with a letter, 48-400 chars", prefix + loop)
        unit = rng.choice(SYMBOL_UNITS)
        loop = unit * -(-rng.randint(160, 600) // len(unit))
        yield Case("symbol/markup run, 160-600 chars", prefix + loop)
        unit = rng.choice(NUMBER_UNITS)
        loop = unit * -(-rng.randint(800, 2000) // len(unit))
        yield Case("number run, 800-2000 chars", prefix + loop)


def the_cases(rng: random.Random, n: int) -> Iterator[Case]:
    for _ in range(n):
        k = rng.randint(12, 100)
        yield Case("'the the the', 12-100 times", "I think that " + "the " * k)


def counter_cases(rng: random.Random, prose: list[str], n: int) -> Iterator[Case]:
    """Counting loops: a cycle of 5..30 tokens with a number that increments every cycle."""
    for _ in range(n):
        prefix = next(chunks(rng.choice(prose), rng, 100, 800))
        unit = token_unit(rng, prose, rng.randint(5, 30))
        repeats = rng.randint(12, 24)
        loop = "".join(f"Step {k}: {unit}\n" for k in range(1, repeats + 1))
        yield Case("counting loop, 12-24 cycles", prefix + "\n" + loop)


def html_cases(rng: random.Random, words: list[str], n: int) -> Iterator[Case]:
    for _ in range(n):
        page = generate_page(rng, words)
        s = page.sections
        k = rng.randrange(len(s))
        copies = rng.randint(2, 6)
        yield Case(
            "html: a section pasted 2-6 times",
            page.html(s[: k + 1] + [s[k]] * (copies - 1) + s[k + 1 :]),
        )
        broken = page.html().replace('id="email"', rng.choice(['id="email-input"', 'id="mail"']))
        yield Case("html: label/aria id renamed", broken)
        html = page.html()
        closers = [m.start() for m in re.finditer(r"</(?:section|div|form|nav|h2|a|table)>", html)]
        for at in sorted(rng.sample(closers, rng.randint(1, 3)), reverse=True):
            html = html[:at] + html[html.index(">", at) + 1 :]
        yield Case("html: 1-3 end tags dropped", html)


def greedy_cases() -> list[Case]:
    if not GREEDY_SAMPLES.exists():
        return []
    samples = json.loads(GREEDY_SAMPLES.read_text())
    return [Case("real greedy samples", s, expect=True) for s in samples if isinstance(s, str)]


# ---------------------------------------------------------------- measuring


@dataclass
class Tally:
    """Verdicts over one corpus or one degenerate kind, and the extremes of its signals."""

    name: str
    n: int = 0
    flagged: int = 0
    flags: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    max_seconds: float = 0.0
    examples: list[tuple[str, QualityReport]] = field(default_factory=list)
    # the measurements each threshold is read from (cycles of language, unless named)
    loop_tokens: list[int] = field(default_factory=list)  # exact token cycles, repeats >= 3
    counting_repeats: list[int] = field(default_factory=list)  # counting cycles, any span
    char_chars: list[int] = field(default_factory=list)  # char cycles, repeats >= 3
    symbol_chars: list[int] = field(default_factory=list)  # ... symbols, markup, repeats >= 3
    number_chars: list[int] = field(default_factory=list)  # ... with digits, repeats >= 3
    seq_rep: list[float] = field(default_factory=list)  # judged windows (enough tokens, words)
    compression: list[float] = field(default_factory=list)  # judged windows
    compression_at_rep: list[float] = field(default_factory=list)  # ... with seq-rep-4 > max

    def add(self, text: str) -> QualityReport:
        start = time.perf_counter()
        m = measure(text)
        report = judge(m, DEFAULT)  # what analyze(text) does, keeping the measurements
        took = time.perf_counter() - start
        self.n += 1
        self.seconds += took
        self.max_seconds = max(self.max_seconds, took)
        self.flagged += report.degenerate
        self.flags.update(report.flags)
        if report.degenerate and len(self.examples) < 5:
            self.examples.append((text, report))
        self._collect(m)
        return report

    def _collect(self, m: Measurements) -> None:
        c = m.loop
        if c is not None and c.repeats >= DEFAULT.min_loop_repeats and is_language(c.unit):
            self.loop_tokens.append(c.span)
        c = m.counting_loop
        if c is not None and is_language(c.unit):
            self.counting_repeats.append(c.repeats)
        c = m.char_loop
        if c is not None and c.repeats >= DEFAULT.min_char_loop_repeats:
            if is_language(c.unit):
                self.char_chars.append(c.span)
            elif any(ch.isdigit() for ch in c.unit):
                self.number_chars.append(c.span)
            else:
                self.symbol_chars.append(c.span)
        g = m.ngrams
        if g.window >= DEFAULT.min_ngram_tokens and g.word_share >= DEFAULT.min_word_share:
            self.seq_rep.append(g.seq_rep_4)
            if m.compression_chars >= DEFAULT.min_compression_chars:
                self.compression.append(m.compression_ratio)
                if g.seq_rep_4 > DEFAULT.max_seq_rep_4:
                    self.compression_at_rep.append(m.compression_ratio)

    @property
    def rate(self) -> float:
        return self.flagged / self.n if self.n else 0.0

    def extremes(self) -> dict[str, float | int | None]:
        top = lambda xs: max(xs) if xs else None  # noqa: E731
        low = lambda xs: round(min(xs), 4) if xs else None  # noqa: E731
        q = lambda xs, p: round(float(np.quantile(xs, p)), 4) if xs else None  # noqa: E731
        return {
            "loop tokens": top(self.loop_tokens),
            "counting repeats": top(self.counting_repeats),
            "char loop chars": top(self.char_chars),
            "symbol loop chars": top(self.symbol_chars),
            "number loop chars": top(self.number_chars),
            "seq-rep-4 p99": q(self.seq_rep, 0.99),
            "seq-rep-4 max": top(self.seq_rep),
            "compression p01": q(self.compression, 0.01),
            "compression min": low(self.compression),
            "compression min, rep": low(self.compression_at_rep),
        }

    def to_dict(self) -> dict:
        return {
            "n": self.n,
            "flagged": self.flagged,
            "rate": round(self.rate, 4),
            "flags": dict(self.flags),
            "mean_ms": round(1000 * self.seconds / max(self.n, 1), 3),
            "max_ms": round(1000 * self.max_seconds, 3),
            **self.extremes(),
        }


def streaming_cost(texts: list[str], rng: random.Random) -> dict[str, float]:
    """Microseconds per `update` with 1-8 character deltas (about one model token each)."""
    updates, seconds = 0, 0.0
    for text in texts:
        s = StreamingAnalyzer()
        i = 0
        start = time.perf_counter()
        while i < len(text):
            step = rng.randint(1, 8)
            s.update(text[i : i + step])
            i += step
            updates += 1
        seconds += time.perf_counter() - start
    return {"updates": updates, "us_per_update": round(1e6 * seconds / max(updates, 1), 1)}


def build_corpora(
    rng: random.Random, limit: int
) -> tuple[dict[str, list[str]], dict[str, list[str]], list[str]]:
    """Healthy corpora (chunked), whole HTML pages, and plain prose to build loops from."""
    licences = unique_texts(Path("/usr/share/common-licenses").iterdir())
    copyright_files = unique_texts(Path("/usr/share/doc").glob("*/copyright"))
    sources = stdlib_sources()
    doc = docstrings(sources) + [zen()]
    python = unique_texts(iter(sources))
    headers = unique_texts(p for p in sorted(Path("/usr/include").rglob("*.h")) if p.is_file())
    machine_html = unique_texts(iter(html_files(rng, rust_sample=300)))
    words = sorted(set(WORDS_RE.findall(" ".join(licences))))
    generated = [generate_page(rng, words).html() for _ in range(400)]
    corpora = {
        "licences": chunked(licences, rng, limit),
        "copyright files": chunked(copyright_files, rng, limit),
        "stdlib docstrings + zen": chunked(doc, rng, limit),
        "stdlib python source": chunked(python, rng, limit),
        "C headers": chunked(headers, rng, limit),
        "HTML on disk": chunked(machine_html, rng, limit),
        "generated HTML": chunked(generated, rng, limit),
    }
    pages = {"whole pages, generated": generated, "whole pages on disk (as found)": machine_html}
    return corpora, pages, licences + doc + copyright_files


def degenerate_cases(rng: random.Random, prose: list[str], n: int) -> list[Case]:
    words = sorted(set(WORDS_RE.findall(" ".join(prose[:50]))))
    return [
        *loop_cases(rng, prose, 2 * n),
        *char_cases(rng, prose, n),
        *the_cases(rng, n),
        *counter_cases(rng, prose, n),
        *html_cases(rng, words, n // 2),
        *greedy_cases(),
    ]


# ---------------------------------------------------------------- output


def fmt(x: float | int | None, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:.2%}" if pct else (f"{x:.3f}" if isinstance(x, float) else str(x))


def print_tables(
    healthy: list[Tally], kinds: list[Tally], stream: dict, show: int
) -> list[ResultTable]:
    """Print the tables; return the same as results (rates in percent)."""
    recorded = []
    t = Table(title="Healthy text: false positives (chunks of 200-1500 chars; whole pages)")
    for col in ("corpus", "n", "flagged", "FP rate", "by detector", "mean ms", "max ms"):
        t.add_column(col, justify="left" if col in ("corpus", "by detector") else "right")
    columns = ["corpus", "n", "flagged", "FP rate %", "by detector", "mean ms", "max ms"]
    recorded.append(ResultTable(t.title or "", columns, []))
    for h in healthy:
        flags = ", ".join(f"{k} {v}" for k, v in h.flags.most_common()) or "-"
        t.add_row(
            h.name,
            str(h.n),
            str(h.flagged),
            fmt(h.rate, True),
            flags,
            f"{1000 * h.seconds / max(h.n, 1):.2f}",
            f"{1000 * h.max_seconds:.1f}",
        )
        recorded[-1].rows.append(
            [
                h.name,
                h.n,
                h.flagged,
                round(100 * h.rate, 2),
                flags,
                round(1000 * h.seconds / max(h.n, 1), 2),
                round(1000 * h.max_seconds, 1),
            ]
        )
    console.print(t)
    t = Table(
        title="Healthy extremes: the largest (smallest) value each threshold must stay beyond. "
        "Cycles of language unless named; repeats >= 3 (counting: any); compression min, rep: "
        "where seq-rep-4 is over its threshold"
    )
    keys = list(healthy[0].extremes())
    t.add_column("corpus")
    for k in keys:
        t.add_column(k, justify="right")
    recorded.append(ResultTable(t.title or "", ["corpus", *keys], []))
    for h in healthy:
        t.add_row(h.name, *(fmt(v) for v in h.extremes().values()))
        extremes = (round(v, 3) if isinstance(v, float) else v for v in h.extremes().values())
        recorded[-1].rows.append([h.name, *extremes])
    console.print(t)
    t = Table(title="Degenerate text: detection")
    for col in ("kind", "n", "detected", "rate", "by detector"):
        t.add_column(col, justify="left" if col in ("kind", "by detector") else "right")
    columns = ["kind", "n", "detected", "rate %", "by detector"]
    recorded.append(ResultTable(t.title or "", columns, []))
    for k in kinds:
        flags = ", ".join(f"{f} {v}" for f, v in k.flags.most_common()) or "-"
        t.add_row(k.name, str(k.n), str(k.flagged), fmt(k.rate, True), flags)
        recorded[-1].rows.append([k.name, k.n, k.flagged, round(100 * k.rate, 2), flags])
    console.print(t)
    console.print(
        f"streaming: {stream['us_per_update']} us per update ({stream['updates']} updates)"
    )
    for h in healthy:
        for text, report in h.examples[:show]:
            console.print(f"[bold]{h.name}[/] flagged: {report.reasons}")
            console.print(repr(text[-300:]), markup=False)
    return recorded


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--chunks", type=int, default=2000, help="at most this many chunks per corpus")
    ap.add_argument("--cases", type=int, default=400, help="degenerate cases per kind (about)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show-fp", type=int, default=2, help="false positives to print per corpus")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON on stdout")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with console.status("reading healthy text"):
        corpora, pages, prose = build_corpora(rng, args.chunks)
    healthy = []
    for name, texts in corpora.items():
        tally = Tally(name)
        with console.status(f"{name}: {len(texts)} chunks"):
            for text in texts:
                tally.add(text)
        healthy.append(tally)
    for name, texts in pages.items():
        tally = Tally(name)
        with console.status(f"{name}: {len(texts)}"):
            for text in texts:
                tally.add(text)
        healthy.append(tally)
    kinds: dict[str, Tally] = {}
    with console.status("degenerate cases"):
        for case in degenerate_cases(rng, prose, args.cases):
            kinds.setdefault(case.kind, Tally(case.kind)).add(case.text)
    stream = streaming_cost(rng.sample(corpora["licences"], 50), rng)
    tables = print_tables(healthy, list(kinds.values()), stream, args.show_fp)
    record(
        "calibrate_quality",
        "Degeneration detectors: false positives on healthy text, detection of degenerate text",
        tables,
        notes=f"Streaming: {stream['us_per_update']} us per update ({stream['updates']} "
        "updates); the healthy corpora are whatever this machine has on disk.",
        threads=1,
    )
    if args.json:
        out = {
            "config": DEFAULT.__dict__,
            "healthy": {h.name: h.to_dict() for h in healthy},
            "degenerate": {k.name: k.to_dict() for k in kinds.values()},
            "streaming": stream,
        }
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
