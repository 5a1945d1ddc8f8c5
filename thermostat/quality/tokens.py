"""Word/punctuation tokens: the unit the loop and n-gram detectors count in.

A token is a maximal run of word characters or one other non-space character (regex
`\\w+|[^\\w\\s]`, Unicode-aware). These are not the model's tokens: the detectors must agree
whatever tokenizer produced the text, and a gateway never sees token ids.

Streaming splits at a *safe cut*: any point whose previous character is not a word character.
No token spans a safe cut, so tokenizing the committed part and the rest separately gives the
same tokens as tokenizing the whole. The trailing run of word characters is held back
(`pending`): the next delta may extend it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

TOKEN_RE = re.compile(r"\w+|[^\w\s]")
_WORD_RUN_RE = re.compile(r"\w*")
_WORD_CHAR_RE = re.compile(r"\w")
_LETTER_RE = re.compile(r"[^\W\d_]")  # a word character that is not a digit or underscore


def tokenize(text: str) -> list[str]:
    """All tokens of `text`, in order."""
    return TOKEN_RE.findall(text)


def has_letter(items: Iterable[str]) -> bool:
    """True when any item contains a letter (not only digits, underscores, punctuation)."""
    return any(_LETTER_RE.search(item) for item in items)


def ends_in_word(text: str) -> bool:
    """True when the last character is a word character: the last token may be cut off."""
    return _WORD_CHAR_RE.match(text[-1:]) is not None


def safe_cut(text: str) -> int:
    """Index of the last safe cut in `text`: where its trailing run of word characters starts."""
    run = _WORD_RUN_RE.match(text[::-1])  # O(len): anchored on the reverse
    assert run is not None  # \w* matches the empty string
    return len(text) - run.end()


class IncrementalTokenizer:
    """Tokens of a text that arrives in pieces; `feed` returns the tokens completed by a piece.

    Invariant: `tokenize(all text fed) == all tokens returned + tokenize(self.pending)`."""

    def __init__(self) -> None:
        self._pending: list[str] = []  # pieces of the trailing word-character run

    @property
    def pending(self) -> str:
        """The trailing run of word characters, not yet a complete token ('' if none)."""
        if len(self._pending) > 1:
            self._pending = ["".join(self._pending)]
        return self._pending[0] if self._pending else ""

    def feed(self, delta: str) -> list[str]:
        cut = safe_cut(delta)
        if cut == 0:  # all word characters (or empty): the pending token grows
            if delta:
                self._pending.append(delta)
            return []
        done = tokenize(self.pending + delta[:cut])
        self._pending = [delta[cut:]] if cut < len(delta) else []
        return done
