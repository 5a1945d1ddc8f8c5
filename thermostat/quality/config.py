"""Every threshold of the degeneration detectors, with the measurement that chose it.

Measured by `benchmarks/calibrate_quality.py --chunks 3000 --seed 0`: healthy text found on the
machine cut into 200-1500 character chunks (299 licence chunks, 3000 each of Debian copyright
files, stdlib docstrings, stdlib Python source, C headers, HTML on disk; 2585 of generated valid
HTML; 400 whole generated pages) against synthetic degenerate text. "Healthy max" below is the
largest value any healthy chunk reached; each threshold sits beyond it. With these values no
healthy chunk or generated page is flagged, and loops of >= 3 cycles covering >= 40 tokens are
detected at 98.8% (the rest are cycles of numbers and punctuation only: data, by design).
Rerun the script after changing a number here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DetectorConfig:
    # ---- loop: exact tail cycle over tokens, of language (loops.py) ----
    max_period_tokens: int = 256  # longest cycle looked for, tokens (a paragraph)
    min_loop_repeats: int = 3  # complete cycles
    min_loop_tokens: int = 32  # tokens covered; healthy max 8 ("# endif" x 3)
    # ---- counting_loop: the same with every number counted as equal ----
    counting_loops: bool = True  # False: no counting_loop flag (the signals stay)
    min_counting_loop_repeats: int = 12  # complete cycles; healthy max 9 ("/* Slot # is
    # reserved */" in a C header); a generated C table of 256 numbered lines goes beyond
    min_counting_loop_tokens: int = 80  # tokens covered
    # ---- char_loop: exact tail cycle over characters ("aaaa", "的的的", "!!!!") ----
    max_period_chars: int = 32  # longest cycle looked for, characters
    min_char_loop_repeats: int = 3  # complete cycles
    min_char_loop_chars: int = 48  # characters covered, language cycle; healthy max 3
    min_symbol_loop_chars: int = 160  # ... symbols, whitespace, markup without words; healthy
    # max 77 ("*" rules in C headers; "</td><td>✔" cells: 47): two 80-column rules
    min_number_loop_chars: int = 800  # ... with digits, no words; healthy max 480 (a number
    # table in the stdlib: "1,\n 40,\n" x 20)
    # ---- repetitive: n-gram repetition AND compressibility, over recent text ----
    ngram_window_tokens: int = 200  # W, tokens
    min_ngram_tokens: int = 100  # windows shorter than this are not judged
    max_seq_rep_4: float = 0.6  # flagged above (and compression below); healthy seq-rep-4
    # reaches 0.75 alone (p99 0.39 licences .. 0.72 copyright files)
    compression_window_chars: int = 2000  # C, characters
    min_compression_chars: int = 400  # windows shorter than this are not judged
    min_compression_ratio: float = 0.09  # flagged below; healthy min 0.107 (copyright
    # files, also where seq-rep-4 > 0.6); synthetic loops: 0.03-0.08
    min_word_share: float = 0.3  # below this the window is data (number tables): not judged
    # ---- HTML (markup.py): every healthy chunk and generated page is clean ----
    max_duplicate_ids: int = 0  # flagged above
    max_dangling_refs: int = 0  # flagged above, in a complete page only
    max_unbalanced_tags: int = 0  # unclosed + stray end tags; flagged above, complete page only


DEFAULT = DetectorConfig()
