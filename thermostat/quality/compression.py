"""Compressibility of the recent text: repetition of any shape, exact or not.

compression ratio = zlib-compressed bytes / raw UTF-8 bytes of the last C characters (level 9,
deflate's 32 KiB window sees all of them). Text that repeats itself, even with small variations
(a counter that increments, a sentence with one word swapped), compresses far better than
healthy text. The ratio of healthy text falls with its length (longer text shares more
substrings), so it is only judged over a window of fixed size and above a minimum length.
"""

from __future__ import annotations

import zlib


def compression_ratio(text: str) -> float:
    """zlib bytes / raw bytes of `text`; 1.0 for empty text."""
    raw = text.encode("utf-8", "surrogatepass")
    return len(zlib.compress(raw, 9)) / len(raw) if raw else 1.0
