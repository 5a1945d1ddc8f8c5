"""A request's generated text and the stop conditions that need it: stop strings, and (with
`stop_on_loop`) a text that certainly ends in a loop.

The scheduler feeds every sampled token that is not a stop token through `add` while it updates
a request, so a request ends on a stop string in the same place, and the same step, as on EOS
or length. The engine takes the released text with `take` when it builds the step's deltas.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from thermostat.engine.detokenizer import IncrementalDetokenizer
from thermostat.quality.streaming import StreamingAnalyzer

# stop_reason of a generation ended by stop_on_loop. finish_reason stays "stop", which every
# client understands (vLLM reports its own finish_reason "repetition", which clients map to
# "stop"); the response's `quality` says which cycle it was.
LOOP_STOP_REASON = "loop"


class OutputText:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop: tuple[str, ...],
        stop_on_loop: bool,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens, stop)
        self._loops = StreamingAnalyzer() if stop_on_loop else None
        self._pending = ""  # released, not yet taken

    def add(self, token_id: int) -> str | None:
        """Feed one generated token; return what ends the text here (a stop string, or
        LOOP_STOP_REASON), else None."""
        delta = self._detok.add(token_id)
        self._pending += delta
        if self._detok.stop_reason is not None:
            return self._detok.stop_reason
        if self._loops is not None and self._loops.update(delta).loop_detected:
            return LOOP_STOP_REASON
        return None

    def take(self, finished: bool) -> str:
        """The text released since the last call; once finished, also what was held back (a
        possible start of a stop string, an unfinished character)."""
        text = self._pending + (self._detok.flush() if finished else "")
        self._pending = ""
        return text
