"""Per-request output constraints: a structured-output grammar compiled against the engine's
tokenizer and followed token by token.

| object                | lifetime     | holds                                                 |
|-----------------------|--------------|-------------------------------------------------------|
| `ConstraintCompiler`  | the engine   | the llguidance tokenizer (built on first use) and one |
|                       |              | compiled matcher per grammar digest (LRU)             |
| `Constraint`          | one request  | its own matcher (a copy of the cached one) and the    |
|                       |              | allowed-token bitmask of its next token               |

The scheduler owns each request's Constraint: `update` advances it with every sampled token (a
grammar that is complete ends the request with "stop"; one that allows no next token ends it
with "error" / "constraint_dead_end"), `schedule` hands the next token's bitmask to the sampler.
Bitmask: int32 words, bit `t % 32` of word `t // 32` set = token t allowed (llguidance's
layout); tokens past the tokenizer's vocabulary (model padding) are never allowed.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import llguidance
import numpy as np
import numpy.typing as npt
from transformers import PreTrainedTokenizerBase

from thermostat.sampling.structured import ConstraintError, StructuredOutput

Bitmask = npt.NDArray[np.int32]
CACHE_SIZE = 256  # compiled grammars kept per engine


def tokenizer_for_grammars(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> llguidance.LLTokenizer:
    """llguidance's view of a fast (tokenizers-backed) Hugging Face tokenizer; the model's
    vocabulary may be larger than the tokenizer's (padding rows)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ConstraintError(None, "structured output needs a fast (tokenizers) tokenizer")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return llguidance.LLTokenizer(
        backend.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
    )


class Constraint:
    """One request's grammar state. `mask()` is the next token's bitmask (computed once per
    state); `advance(token)` moves past a sampled token."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, spec: StructuredOutput):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.spec = spec
        self._mask: Bitmask | None = None

    def mask(self) -> Bitmask:
        if self._mask is None:
            mask = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
            self.matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            self._mask = mask
        return self._mask

    def advance(self, token: int) -> bool:
        """Consume a sampled token; False if the grammar refused it (never after `mask`)."""
        self._mask = None
        return bool(self.matcher.consume_token(token)) and not self.matcher.is_error()

    def lookahead(self, tokens: list[int]) -> tuple[list[int], list[Bitmask]]:
        """The longest prefix of `tokens` (proposals) the grammar takes without completing or
        reaching a dead end, and the bitmask after each of its tokens; the state is left as it
        was (the proposals are consumed, then rolled back)."""
        first = mask = self.mask()
        masks: list[Bitmask] = []
        for token in tokens:
            allowed = 0 <= token < self.vocab_size and mask[token // 32] >> (token % 32) & 1
            if not allowed or not self.advance(token):
                break
            if self.complete or not self.allows_any(()):
                self.matcher.rollback(1)
                break
            mask = self.mask()
            masks.append(mask)
        self.matcher.rollback(len(masks))
        self._mask = first
        return tokens[: len(masks)], masks

    @property
    def complete(self) -> bool:
        """The grammar admits nothing more: the output is whole."""
        return bool(self.matcher.is_stopped())

    def allows_any(self, banned: tuple[int, ...]) -> bool:
        """Some token is allowed next besides `banned` (stop tokens before min_tokens)."""
        allowed = allowed_ids(self.mask(), self.vocab_size, limit=len(banned) + 1)
        return any(t not in banned for t in allowed)

    @property
    def error(self) -> str:
        return str(self.matcher.get_error())


def allowed_ids(mask: Bitmask, vocab_size: int, limit: int | None = None) -> list[int]:
    """Token ids whose bit is set (the first `limit` of them)."""
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size]
    ids = np.flatnonzero(bits)
    return ids[:limit].tolist() if limit is not None else ids.tolist()


class ConstraintCompiler:
    """Compiles StructuredOutputs for one tokenizer, caching compiled grammars (LRU)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def compile(self, spec: StructuredOutput) -> Constraint:
        """A fresh Constraint; raises ConstraintError (naming the field) for a grammar that
        does not compile against this tokenizer."""
        key = spec.grammar
        matcher = self._cache.get(key)
        if matcher is None:
            if self._lltokenizer is None:
                self._lltokenizer = tokenizer_for_grammars(
                    self.tokenizer, self.vocab_size, self.eos_token_ids
                )
            matcher = llguidance.LLMatcher(self._lltokenizer, spec.grammar, log_level=0)
            if matcher.is_error():
                raise ConstraintError(spec.param, f"{spec.param}: {matcher.get_error()}")
            self._cache[key] = matcher
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return Constraint(matcher.deep_copy(), self.vocab_size, spec)
