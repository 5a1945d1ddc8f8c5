"""Incremental detokenization with stop strings.

Text is released only when it is final: a UTF-8 character split across tokens waits for its
last byte (tokenizers' DecodeStream does that), and a tail that could be the start of a stop
string waits until it either completes the stop string or cannot anymore. Stop strings are
never part of the output text.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

PROMPT_CONTEXT_TOKENS = 4  # prompt tokens fed first, so the first output token decodes in context


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop: tuple[str, ...] = (),
    ) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        context = [t for t in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:] if t < self._vocab_size]
        self._stream = DecodeStream(context, skip_special_tokens)
        self._stop = stop
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._decoded = ""  # everything decoded so far
        self._released = 0  # chars of _decoded handed out
        self.stop_reason: str | None = None  # the stop string that ended the text

    @property
    def text(self) -> str:
        """The released text."""
        return self._decoded[: self._released]

    def add(self, token_id: int) -> str:
        """Feed one token; return the newly released text (maybe empty). After a stop string
        matched, `stop_reason` is set and nothing more is released."""
        if self.stop_reason is not None:
            return ""
        self._ids.append(token_id)
        piece = self._stream.step(self._backend, token_id) if token_id < self._vocab_size else None
        if piece:
            self._decoded += piece
        return self._release()

    def flush(self) -> str:
        """Release what was held back (the generation ended): a possible stop-string start, and
        bytes of an unfinished character (decoded as U+FFFD, as a full decode would)."""
        if self.stop_reason is not None:
            return ""
        ids = [t for t in self._ids if t < self._vocab_size]
        full = self._backend.decode(ids, skip_special_tokens=self._skip_special)
        if full.startswith(self._decoded):
            self._decoded = full
        delta = self._decoded[self._released :]
        self._released = len(self._decoded)
        return delta

    def _release(self) -> str:
        if self._stop:
            longest = max(len(s) for s in self._stop)
            search_from = max(self._released - longest + 1, 0)
            hits = [(i, s) for s in self._stop if (i := self._decoded.find(s, search_from)) >= 0]
            if hits:
                index, stop = min(hits)
                self._decoded = self._decoded[:index]
                self.stop_reason = stop
                delta = self._decoded[self._released :]
                self._released = len(self._decoded)
                return delta
        end = len(self._decoded) - self._partial_stop_suffix()
        delta = self._decoded[self._released : end]
        self._released = max(end, self._released)
        return delta

    def _partial_stop_suffix(self) -> int:
        """Length of the longest tail of the decoded text that begins some stop string."""
        best = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self._decoded)), best, -1):
                if self._decoded.endswith(stop[:k]):
                    best = k
                    break
        return best
