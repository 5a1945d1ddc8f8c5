"""Logprobs in the two OpenAI shapes.

Chat:        `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{...}]}]}`
Completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`;
with `echo` the prompt's tokens come first, the first of them without a logprob (None).

Logprobs are natural logs of the raw model distribution (before temperature and filters).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from transformers import PreTrainedTokenizerBase

from thermostat.engine.steps import TokenLogprobs


class TokenText:
    """The text and UTF-8 bytes of single tokens (a token may hold part of a character)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    # ignores: transformers types decode's result as `str | list[str]`; one sequence gives a str
    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)  # type: ignore[return-value]

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)  # type: ignore[return-value]

    def _bytes(self, token_id: int) -> list[int]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        raw = _byte_level_bytes(piece) if isinstance(piece, str) else None
        return list(raw if raw is not None else self.text(token_id).encode("utf-8"))


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable stand-ins for the 256 byte values, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _byte_level_bytes(piece: str) -> bytes | None:
    table = _byte_decoder()
    if not piece or any(ch not in table for ch in piece):
        return None
    return bytes(table[ch] for ch in piece)


def chat_logprobs(entries: list[TokenLogprobs], tokens: TokenText) -> dict[str, Any]:
    """One `content` item per generated token, with its `top_logprobs` alternatives."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": tokens.text(token_id), "logprob": logprob, "bytes": tokens.bytes(token_id)}

    return {
        "content": [
            item(e.token_id, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


def completion_logprobs(
    entries: Sequence[TokenLogprobs | None],
    token_ids: list[int],
    tokens: TokenText,
    text_offset: int = 0,
) -> dict[str, Any]:
    """`entries[i]` scores `token_ids[i]` (None: no logprob, the first prompt token). The top
    alternatives always include the token itself, as OpenAI's legacy API does."""
    texts = [tokens.text(t) for t in token_ids]
    offsets = []
    for text in texts:
        offsets.append(text_offset)
        text_offset += len(text)
    top: list[dict[str, float] | None] = []
    for token_id, e in zip(token_ids, entries, strict=True):
        if e is None:
            top.append(None)
            continue
        alternatives = {tokens.text(t): lp for t, lp in e.top}
        alternatives.setdefault(tokens.text(token_id), e.logprob)
        top.append(alternatives)
    return {
        "tokens": texts,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }
