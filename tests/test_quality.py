"""Degeneration detectors: healthy text passes, loops and broken HTML are caught, the streaming
form agrees with the one-shot form, and the CLI exits 0/1/2."""

from __future__ import annotations

import argparse
import io
import json
import random
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thermostat.quality import (
    DEFAULT,
    DetectorConfig,
    StreamingAnalyzer,
    analyze,
    check_markup,
    quality_report,
)
from thermostat.quality import cli as quality_cli
from thermostat.quality.cycles import TailRuns, best_cycle, tail_runs
from thermostat.quality.loops import ends_in_loop, loop_in_tail
from thermostat.quality.markup import has_markup
from thermostat.quality.tokens import IncrementalTokenizer, tokenize

LICENCE = Path("/usr/share/common-licenses/GPL-3")
PROLOGUE = "Here is the answer you asked for, with some detail:\n"


def stdlib_source() -> str:
    return Path(textwrap.__file__).read_text()


def licence_text() -> str:
    if not LICENCE.exists():
        pytest.skip("no /usr/share/common-licenses on this machine")
    return LICENCE.read_text()


def valid_page() -> str:
    return """<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>Contact</title><link rel="stylesheet" href="s.css"></head>
<body>
<nav id="nav" aria-label="Contents"><ul><li><a href="#about">About</a><li><a href="#contact">
Contact</a></ul></nav>
<main id="main">
<section id="about" aria-labelledby="about-h"><h2 id="about-h">About</h2>
<p>We make thermostats.<br>They keep rooms warm.<p>Since 1990.</p>
<img src="a.png" alt="logo"></section>
<section id="contact">
<form id="f"><label for="email">Email</label>
<input id="email" type="email" aria-describedby="hint"><p id="hint">Never shared.</p>
<button type="submit" form="f">Send</button></form></section>
</main>
<footer><a href="#top">Back to top</a></footer>
<script>document.getElementById("email").focus();</script>
</body>
</html>
"""


def stream(text: str, cuts: list[int], config: DetectorConfig = DEFAULT) -> StreamingAnalyzer:
    s = StreamingAnalyzer(config)
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        s.update(text[a:b])
    return s


# ---- healthy text ----


@pytest.mark.parametrize("size", [None, 1500, 400])
def test_licence_is_healthy(size: int | None) -> None:
    text = licence_text()
    pieces = [text] if size is None else [text[i : i + size] for i in range(0, len(text), size)]
    flagged = [(p[-80:], analyze(p).reasons) for p in pieces if analyze(p).degenerate]
    assert not flagged


def test_stdlib_source_is_healthy() -> None:
    text = stdlib_source()
    assert not analyze(text).degenerate
    chunks = [text[i : i + 1200] for i in range(0, len(text), 1200)]
    assert not [c for c in chunks if analyze(c).degenerate]


def test_valid_page_is_clean() -> None:
    report = analyze(valid_page())
    assert report.degenerate is False, report.reasons
    assert report.markup is not None and report.markup.complete
    assert report.markup.duplicate_ids == ()
    assert report.markup.dangling_refs == ()
    assert report.markup.unclosed_tags == () and report.markup.stray_end_tags == ()
    assert report.signals["html_duplicate_ids"] == 0


def test_short_and_empty_texts() -> None:
    for text in ["", "x", "ok", "Yes.", "ha ha", "1 2 1 2", "\n\n"]:
        report = analyze(text)
        assert not report.degenerate, (text, report.reasons)
    assert analyze("").signals["tokens"] == 0


# ---- loops ----


@pytest.mark.parametrize(
    ("unit", "period", "repeats"),
    [
        ("The cat sat on the mat. ", 7, 9),
        ("I am not sure. ", 5, 8),
        ("Please call me back as soon as you can, thank you! ", 13, 3),
        ("word ", 1, 40),
        ("<li>item</li>\n", 8, 6),
    ],
)
def test_loop_reported_with_period_and_count(unit: str, period: int, repeats: int) -> None:
    report = analyze(PROLOGUE + unit * repeats)
    assert report.degenerate and report.flags[0] == "loop"
    assert report.signals["loop_period"] == period
    assert report.signals["loop_repeats"] == repeats
    assert report.signals["loop_tokens"] == period * repeats
    assert f"a {period}-token cycle repeated {repeats} times" in report.reasons[0]


def test_loop_cut_mid_word_still_counts() -> None:
    text = PROLOGUE + "The cat sat on the mat. " * 6 + "The cat sa"
    report = analyze(text)
    assert report.flags[0] == "loop"
    assert (report.signals["loop_period"], report.signals["loop_repeats"]) == (7, 6)
    assert report.signals["loop_tokens"] == 7 * 6 + 3


def test_the_the_the() -> None:
    report = analyze("I think that " + "the " * 40)
    assert report.degenerate and report.flags[0] == "loop"
    assert report.signals["loop_period"] == 1 and report.signals["loop_repeats"] == 40
    short = analyze("I think that " + "the " * 15)  # 15 tokens: caught by characters
    assert short.degenerate and short.flags[0] == "char_loop"


@pytest.mark.parametrize(
    ("text", "period"),
    [
        ("Answer: " + "a" * 80, 1),
        ("Answer: " + "ha" * 40, 2),
        ("结果是" + "的" * 60, 1),
        ("x = '" + "abc" * 30, 3),
        ("Wow" + "!" * 200, 1),
    ],
)
def test_character_loops(text: str, period: int) -> None:
    report = analyze(text)
    assert report.degenerate, report.signals
    assert "char_loop" in report.flags or "loop" in report.flags
    if report.flags[0] == "char_loop":
        assert report.signals["char_loop_period"] == period


@pytest.mark.parametrize(
    "tail",
    [
        "Title\n" + "=" * 79 + "\n\nSome text here.\n" + "-" * 100,  # rules
        "<table><tr><td>" * 5 + "x" + "</td></tr></table>" * 5,  # nesting closes
        "<tr>" + "<td>✔</td>" * 14,  # a row of cells without words
        "data = [" + "0, " * 150,  # a number table
        "x = [\n" + "    1,\n    40,\n" * 25,
        "}\n" * 40,
    ],
)
def test_healthy_repetition_is_not_a_loop(tail: str) -> None:
    report = analyze(PROLOGUE + tail)
    assert not report.degenerate, report.reasons


@pytest.mark.parametrize(
    "tail", ["<div>" * 40, "0, " * 300, "\n" * 200, "!?" * 100, "<td></td>" * 20]
)
def test_long_symbol_markup_and_number_runs_are_loops(tail: str) -> None:
    report = analyze(PROLOGUE + tail)
    assert report.flags and report.flags[0] == "char_loop", report.signals


def test_paragraph_loop() -> None:
    rng = random.Random(3)
    words = [w for w in Path(textwrap.__file__).read_text().split() if w.isalpha()]
    paragraph = " ".join(rng.choice(words) for _ in range(150)) + "\n\n"
    report = analyze(PROLOGUE + paragraph * 3)
    assert report.flags[0] == "loop"
    assert report.signals["loop_repeats"] == 3
    assert report.signals["loop_period"] == len(tokenize(paragraph))


def test_counting_loop() -> None:
    text = PROLOGUE + "".join(f"Step {k}: repeat the previous step.\n" for k in range(1, 16))
    report = analyze(text)
    assert report.flags[0] == "counting_loop"
    assert report.signals["counting_loop_period"] == 8
    assert report.signals["counting_loop_repeats"] == 15
    assert "Step # : repeat the previous step ." in report.reasons[0]
    assert report.signals["loop_repeats"] < 3  # not an exact loop
    assert not analyze(text, DetectorConfig(counting_loops=False)).degenerate


def test_repetitive_without_exact_loop() -> None:
    rng = random.Random(0)
    sentences = ["the cat sat on the mat", "the dog sat on the rug", "a bird sat on the roof"]
    text = ". ".join(rng.choice(sentences) for _ in range(60)) + ". The end"
    report = analyze(text)
    assert report.flags == ("repetitive",), report.reasons
    assert report.signals["seq_rep_4"] > DEFAULT.max_seq_rep_4


# ---- loops over model token ids (tools/demo_sweep.py) ----

IDS_LOOP = DetectorConfig(max_period_tokens=50, min_loop_repeats=2, min_loop_tokens=60)


def test_ids_ending_in_a_loop() -> None:
    unit = [11, 12, 13, 14, 15, 16, 17]
    ids = list(range(100, 140)) + unit * 12 + unit[:3]
    loop = ends_in_loop(ids, IDS_LOOP)
    assert loop is not None
    assert (loop.period, loop.span, loop.repeats) == (7, 7 * 12 + 3, 12)
    assert loop.unit == tuple(str(t) for t in unit)
    assert loop_in_tail(ids, 100, IDS_LOOP) == loop
    # No language test over ids; the default thresholds need 3 cycles and 32 items.
    assert ends_in_loop([5, 6] * 16) is not None and ends_in_loop([5, 6] * 15 + [5]) is None


def test_ids_loop_thresholds() -> None:
    assert ends_in_loop([1] * 60, IDS_LOOP) is not None
    assert ends_in_loop([2] + [1] * 59, IDS_LOOP) is None  # span 59 < 60
    unit = list(range(40))
    assert ends_in_loop(unit * 2, IDS_LOOP).period == 40  # 2 cycles, span 80
    assert ends_in_loop(unit + unit[:35], IDS_LOOP) is None  # span 75 < 2 x 40
    assert ends_in_loop(list(range(51)) * 3, IDS_LOOP) is None  # period > 50


def test_loop_left_before_the_end_is_only_in_the_tail() -> None:
    looped = [1, 2, 3] * 25 + [9, 8, 7, 6, 5]
    assert ends_in_loop(looped, IDS_LOOP) is None
    assert loop_in_tail(looped, 100, IDS_LOOP).period == 3
    assert loop_in_tail(looped + list(range(100, 130)), 100, IDS_LOOP).span == 65
    # Only the 55 ids of the loop inside the last 100 count.
    assert loop_in_tail(looped + list(range(100, 145)), 100, IDS_LOOP) is None


def _periodic_stretches(ids: list[int], max_period: int) -> list[tuple[int, int, int]]:
    """(period, start, end) of every maximal stretch with ids[i] == ids[i + period]."""
    out = []
    for p in range(1, max_period + 1):
        start = 0
        for i in range(len(ids) + 1):
            if i + p >= len(ids) or ids[i] != ids[i + p]:
                if i + p - start > p:  # at least one match: the stretch is [start, i + p)
                    out.append((p, start, min(i + p, len(ids))))
                start = i + 1
    return out


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2), max_size=40),
    min_span=st.integers(1, 12),
    repeats=st.integers(2, 3),
    window=st.integers(1, 30),
)
def test_ids_loops_match_their_definition(
    ids: list[int], min_span: int, repeats: int, window: int
) -> None:
    """Brute force: a loop is a stretch with period p <= 5 of at least max(min_span,
    repeats x p) ids; `ends_in_loop` wants one at the very end, `loop_in_tail` one inside the
    last `window` ids."""
    config = DetectorConfig(max_period_tokens=5, min_loop_repeats=repeats, min_loop_tokens=min_span)
    n = len(ids)
    loops = [
        (p, a, b) for p, a, b in _periodic_stretches(ids, 5) if b - a >= max(min_span, repeats * p)
    ]
    at_end = [(p, b - a) for p, a, b in loops if b == n]
    found = ends_in_loop(ids, config)
    assert (found is not None) == bool(at_end)
    if found is not None:  # longest span, then shortest period
        assert (found.period, found.span) == min(at_end, key=lambda c: (-c[1], c[0]))
    in_window = any(b - max(a, n - window) >= max(min_span, repeats * p) for p, a, b in loops)
    assert (loop_in_tail(ids, window, config) is not None) == in_window


# ---- HTML ----


def test_duplicate_ids_found_by_name() -> None:
    page = valid_page().replace('<main id="main">', '<main id="main"><div id="nav">x</div>')
    page = page.replace("<p>Since 1990.</p>", '<p id="main">Since 1990.</p>')
    report = analyze(page)
    assert report.markup is not None and report.markup.duplicate_ids == ("nav", "main")
    assert "html_duplicate_ids" in report.flags
    assert "2 duplicate HTML ids: nav, main" in report.reasons


@pytest.mark.parametrize(
    ("old", "new", "ref"),
    [
        ('<a href="#about">', '<a href="#aboutus">', ("aboutus", "href")),
        ('<label for="email">', '<label for="e-mail">', ("e-mail", "for")),
        ('aria-describedby="hint"', 'aria-describedby="hint more"', ("more", "aria-describedby")),
        (
            'aria-labelledby="about-h"',
            'aria-labelledby="about-title"',
            ("about-title", "aria-labelledby"),
        ),
        ('getElementById("email")', 'getElementById("mail")', ("mail", "script")),
    ],
)
def test_dangling_references_found(old: str, new: str, ref: tuple[str, str]) -> None:
    page = valid_page()
    assert old in page
    report = analyze(page.replace(old, new))
    assert report.markup is not None and report.markup.dangling_refs == (ref,)
    assert report.flags == ("html_dangling_refs",)
    assert ref[0] in report.reasons[0]


def test_dangling_references_wait_for_a_complete_page() -> None:
    fragment = '<form><label for="email">Email</label><input id="mail"></form>'
    report = analyze(fragment)
    assert report.markup is not None and report.markup.dangling_refs == (("email", "for"),)
    assert not report.degenerate  # the element may still come: not judged in a fragment


def test_unbalanced_tags_found() -> None:
    page = valid_page().replace("</section>\n<section", "\n<section", 1)
    page = page.replace("</nav>", "</nav></span>")
    report = analyze(page)
    assert report.markup is not None
    assert report.markup.unclosed_tags == ("section",)
    assert report.markup.stray_end_tags == ("span",)
    assert report.flags == ("html_unbalanced",)


def test_markup_detection_and_fragment_rules() -> None:
    assert not has_markup("if (a<b && c>d) return x<y>z;")
    assert not has_markup("#include <stdio.h>\nint main(void) { return 0; }")
    assert has_markup("<p>hi</p>") and has_markup("<!DOCTYPE html>")
    assert check_markup("plain prose, no tags") is None
    page = '<html><body><h2 id="a%20b">x</h2><a href="#a%20b">1</a><a href="#">2</a></body></html>'
    page2 = '<html><body><h2 id="a b">x</h2><a href="#a%20b">y</a></body></html>'
    for p in (page, page2):
        report = check_markup(p)
        assert report is not None and report.dangling_refs == (), p


def test_pasted_block_in_a_page() -> None:
    block = '<section id="faq"><h2 id="faq-h">FAQ</h2><p>Ask us.</p></section>\n'
    page = valid_page().replace("</main>", block * 4 + "</main>")
    report = analyze(page)
    assert report.markup is not None and set(report.markup.duplicate_ids) == {"faq", "faq-h"}


# ---- streaming ----


WORDS = ["the", "cat", "sat", "on", "mat", "1", "22", "é", "的", "<p>", "</p>", ",", ".", "!", "a"]
SEPS = [" ", " ", " ", "\n", "", "  "]


@st.composite
def texts(draw: st.DrawFn) -> str:
    words = st.lists(st.tuples(st.sampled_from(WORDS), st.sampled_from(SEPS)), max_size=40)
    prefix = "".join(w + s for w, s in draw(words))
    unit = "".join(w + s for w, s in draw(words))
    tail = draw(st.text(alphabet="ab <>/=\"'#1.\n", max_size=12))
    return prefix + unit * draw(st.integers(0, 14)) + tail


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts(), data=st.data())
def test_streaming_equals_one_shot(text: str, data: st.DataObject) -> None:
    cuts = data.draw(st.lists(st.integers(0, max(len(text), 1)), max_size=len(text) // 2 + 2))
    s = stream(text, cuts)
    assert s.text == text
    assert s.report() == analyze(text)
    assert s.state.loop_detected == any(f in ("loop", "char_loop") for f in analyze(text).flags)


@pytest.mark.parametrize("seed", range(4))
def test_streaming_equals_one_shot_on_real_text(seed: int) -> None:
    rng = random.Random(seed)
    source = stdlib_source()
    start = rng.randrange(0, len(source) - 3000)
    for text in (
        source[start : start + rng.randint(200, 3000)],
        PROLOGUE + "The cat sat on the mat. " * rng.randint(3, 12) + "The ca",
        valid_page(),
        "Answer: " + "的" * rng.randint(10, 90),
        "".join(f"{k}. Apples and pears.\n" for k in range(1, rng.randint(3, 30))),
    ):
        cuts = [rng.randrange(len(text)) for _ in range(rng.randint(0, len(text)))]
        s = stream(text, cuts)
        assert s.report() == analyze(text)
        assert s.report().to_dict() == quality_report(text)


def test_loop_detected_before_the_end() -> None:
    text = PROLOGUE + "The cat sat on the mat. " * 20
    s = StreamingAnalyzer()
    first = None
    for i in range(0, len(text), 3):
        if s.update(text[i : i + 3]).loop_detected and first is None:
            first = i + 3
    assert first is not None and first < len(text) // 2
    assert s.state.loop is not None and s.state.loop.period == 7
    report = s.report()
    assert report.flags[0] == "loop" and "7-token cycle" in report.reasons[0]


def test_loop_detected_never_on_healthy_text() -> None:
    rng = random.Random(1)
    for text in (licence_text()[:20000], stdlib_source(), valid_page()):
        s = StreamingAnalyzer()
        i = 0
        while i < len(text):
            step = rng.randint(1, 8)
            assert not s.update(text[i : i + step]).loop_detected, text[max(0, i - 200) : i + 8]
            i += step


# ---- the pieces ----


@settings(max_examples=200, deadline=None)
@given(seq=st.lists(st.sampled_from("aab"), max_size=60), period=st.integers(1, 12))
def test_tail_runs_incremental_equals_one_shot(seq: list[str], period: int) -> None:
    runs = TailRuns(period)
    for item in seq:
        runs.push(item)
    ids = np.array([ord(c) for c in seq], dtype=np.int64)
    one_shot = tail_runs(ids, period)
    assert runs.runs == one_shot
    for p, r in one_shot.items():  # the definition, directly
        assert all(seq[i] == seq[i - p] for i in range(len(seq) - r, len(seq)))
        assert r == len(seq) - p or seq[len(seq) - r - 1] != seq[len(seq) - r - 1 - p]
    qualifies = lambda c: c.repeats >= 3  # noqa: E731
    a = best_cycle(runs.runs, lambda p: seq[-2 * p :], qualifies)
    b = best_cycle(one_shot, lambda p: seq[-2 * p :], qualifies)
    assert a == b


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab1 ,.\n的é_", max_size=50), data=st.data())
def test_incremental_tokenizer(text: str, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    tok = IncrementalTokenizer()
    out: list[str] = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=False):
        out += tok.feed(text[a:b])
    assert out + tokenize(tok.pending) == tokenize(text)


def test_quality_report_is_json() -> None:
    for text in ("", "hello", PROLOGUE + "again and again " * 30, valid_page()):
        report = quality_report(text)
        assert json.loads(json.dumps(report)) == report
        assert set(report) >= {"degenerate", "signals", "reasons", "flags"}
        assert isinstance(report["degenerate"], bool)
        assert report["degenerate"] == bool(report["reasons"])


# ---- CLI ----


def cli_run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="thermostat")
    quality_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["analyze", *argv])
    return args.run(args)


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    healthy = tmp_path / "ok.txt"
    healthy.write_text(stdlib_source()[:3000])
    looping = tmp_path / "loop.txt"
    looping.write_text(PROLOGUE + "The cat sat on the mat. " * 10)
    binary = tmp_path / "bin.dat"
    binary.write_bytes(b"\xff\xfe\x00 not utf-8 \xc3")
    assert cli_run([str(healthy)]) == 0
    assert "healthy" in capsys.readouterr().out
    assert cli_run([str(looping)]) == 1
    assert "7-token cycle repeated 10 times" in capsys.readouterr().out
    assert cli_run([str(looping), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["signals"]["loop_repeats"] == 10
    assert cli_run([str(tmp_path / "missing.txt")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert cli_run([str(binary)]) == 2
    assert "not UTF-8" in capsys.readouterr().err
    assert cli_run([str(tmp_path)]) == 2


def test_cli_reads_stdin(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    stdin = io.TextIOWrapper(io.BytesIO(("x " + "the " * 50).encode()))
    monkeypatch.setattr("sys.stdin", stdin)
    assert cli_run(["-", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["degenerate"] is True
    parser = argparse.ArgumentParser(prog="thermostat")
    sub = quality_cli.add_parser(parser.add_subparsers())
    assert "examples:" in sub.format_help() and "exit status" in sub.format_help()
