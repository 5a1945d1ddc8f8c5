"""What a client may ask for (`SamplingParams`, every field optional) and what the engine runs
with (`EffectiveParams`, every field concrete). Their fields are those of the table in
`sampling/fields.py`, which validates them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from thermostat.sampling.fields import (
    FIELD,
    FIELDS,
    REPORTED_FIELDS,
    SamplingParamError,
)
from thermostat.sampling.repetition_detection import RepetitionDetection
from thermostat.sampling.structured import StructuredOutput


def validate_layered(name: str, value: Any) -> None:
    """Raise SamplingParamError unless `value` is a valid setting of layered field `name`."""
    field = FIELD.get(name)
    if field is None or not field.layered:
        raise SamplingParamError(name, "is not a layered sampling field")
    field.check(value)


@dataclass
class SamplingParams:
    """A request's sampling fields. None means "not sent": the resolver fills it from the layers.

    Never give a field a non-None default here: an omitted field must not look like a field sent
    with the default value (the case study's failure)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    dry_sequence_breakers: list[str] | None = None
    ignore_eos: bool | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool | None = None
    # Not table fields: objects checked when built (sampling/structured.py,
    # sampling/repetition_detection.py), never layered.
    structured: StructuredOutput | None = None
    repetition_detection: RepetitionDetection | None = None

    def sent(self) -> dict[str, Any]:
        """The fields that were set, as a dict."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: v for k, v in values.items() if v is not None}

    def validate(self) -> None:
        """Raise SamplingParamError for the first invalid field (in the table's order)."""
        for field in FIELDS:
            value = getattr(self, field.name)
            if value is not None:
                field.check(value)
        if (
            self.max_tokens is not None
            and self.min_tokens is not None
            and self.min_tokens > self.max_tokens
        ):
            raise SamplingParamError("min_tokens", "must not exceed max_tokens")


@dataclass(frozen=True)
class EffectiveParams:
    """The values one generation runs with. Temperature 0 means greedy (argmax)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    dry_multiplier: float
    dry_base: float
    dry_allowed_length: int
    dry_penalty_last_n: int
    xtc_probability: float
    xtc_threshold: float
    max_tokens: int | None  # None: the room the prompt leaves in the context, until fitted
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", '"', "*")
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None  # the output's grammar, if constrained
    repetition_detection: RepetitionDetection | None = None  # vLLM's: end a repeating output

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sampling_dict(self) -> dict[str, Any]:
        """The `sampling.effective` object: the layered fields, then max_tokens and seed."""
        return {name: getattr(self, name) for name in REPORTED_FIELDS}
