"""vLLM's per-request `repetition_detection`: end a generation whose output tokens end in a
pattern of `min_pattern_size`..`max_pattern_size` tokens repeated `min_count` times in a row
(finish_reason "repetition", stop_reason "repetition_detected", as vLLM reports it).

Checked after every output token once `min_tokens` are out, like vLLM's scheduler
(`check_sequence_repetition`); the token-level sibling of `--stop-on-loop`, which judges the
text with the quality detectors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from thermostat.sampling.fields import SamplingParamError

FIELD = "repetition_detection"


@dataclass(frozen=True)
class RepetitionDetection:
    max_pattern_size: int  # 0 = off
    min_pattern_size: int = 0  # 0 = 1
    min_count: int = 0  # >= 2 when on

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> RepetitionDetection:
        """From a request body's object; SamplingParamError naming the field at fault."""
        unknown = sorted(set(body) - {"max_pattern_size", "min_pattern_size", "min_count"})
        if unknown:
            raise SamplingParamError(f"{FIELD}.{unknown[0]}", "is not a field of it")
        values = {}
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = body.get(name, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise SamplingParamError(
                    f"{FIELD}.{name}", f"must be an integer >= 0, got {value!r}"
                )
            values[name] = value
        made = cls(**values)
        if made.min_pattern_size > made.max_pattern_size:
            raise SamplingParamError(
                f"{FIELD}.min_pattern_size", "must not exceed max_pattern_size"
            )
        if made.max_pattern_size > 0 and made.min_count < 2:
            raise SamplingParamError(
                f"{FIELD}.min_count", "must be >= 2 when max_pattern_size is set"
            )
        return made

    def ends(self, tokens: Sequence[int], min_tokens: int) -> bool:
        """Whether a generation of output `tokens` ends here: min_tokens are out and found."""
        return len(tokens) >= min_tokens and self.found(tokens)

    def found(self, tokens: Sequence[int]) -> bool:
        """Whether `tokens` end in a pattern of an allowed size repeated min_count times."""
        if self.max_pattern_size <= 0:
            return False
        for size in range(max(self.min_pattern_size, 1), self.max_pattern_size + 1):
            span = size * self.min_count
            if span > len(tokens):
                return False
            tail = tokens[len(tokens) - span :]
            if all(tail[i] == tail[i % size] for i in range(size, span)):
                return True
        return False
