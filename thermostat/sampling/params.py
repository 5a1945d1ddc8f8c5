"""What a client may ask for (`SamplingParams`, every field optional) and what the engine runs
with (`EffectiveParams`, every field concrete)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from thermostat.errors import InvalidRequest

# Fields resolved through the layers request > operator > recommended > generation_config >
# builtin. The other fields belong to one request only and take their builtin value when unset.
LAYERED_FIELDS: tuple[str, ...] = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)

# Neutral OpenAI-style values: the `builtin` layer.
BUILTIN: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
}


class SamplingParamError(InvalidRequest):
    """A sampling value out of range or of the wrong type; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(param, f"{param}: {message}")


INT64 = (-(2**63), 2**63 - 1)  # integers become int64 tensors / generator seeds in the engine


def _check_number(name: str, value: Any, *, integer: bool = False) -> None:
    ok_types = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_types):
        kind = "an integer" if integer else "a number"
        raise SamplingParamError(name, f"must be {kind}, got {value!r}")
    if integer and not INT64[0] <= value <= INT64[1]:
        raise SamplingParamError(name, f"must fit a signed 64-bit integer, got {value}")


def validate_layered(name: str, value: Any) -> None:
    """Raise SamplingParamError unless `value` is a valid setting of layered field `name`."""
    _check_number(name, value, integer=name == "top_k")
    if name == "temperature" and not 0.0 <= value <= 2.0:
        raise SamplingParamError(name, f"must be in [0, 2] (0 = greedy), got {value}")
    if name == "top_p" and not 0.0 < value <= 1.0:
        raise SamplingParamError(name, f"must be in (0, 1], got {value}")
    if name == "top_k" and not (value == -1 or value >= 1):
        raise SamplingParamError(name, f"must be -1 (off) or >= 1, got {value}")
    if name == "min_p" and not 0.0 <= value <= 1.0:
        raise SamplingParamError(name, f"must be in [0, 1], got {value}")
    if name == "repetition_penalty" and not 0.0 < value <= 10.0:
        raise SamplingParamError(name, f"must be in (0, 10] (1 = off), got {value}")
    if name in ("frequency_penalty", "presence_penalty") and not -2.0 <= value <= 2.0:
        raise SamplingParamError(name, f"must be in [-2, 2], got {value}")


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
    max_tokens: int | None = None
    min_tokens: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool | None = None

    def sent(self) -> dict[str, Any]:
        """The fields that were set, as a dict."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def validate(self) -> None:
        """Raise SamplingParamError for the first invalid field."""
        for name in LAYERED_FIELDS:
            value = getattr(self, name)
            if value is not None:
                validate_layered(name, value)
        for name, low in (("max_tokens", 0), ("min_tokens", 0), ("n", 1), ("logprobs", 0)):
            value = getattr(self, name)
            if value is not None:
                _check_number(name, value, integer=True)
                if value < low:
                    raise SamplingParamError(name, f"must be >= {low}, got {value}")
        if self.prompt_logprobs is not None:
            _check_number("prompt_logprobs", self.prompt_logprobs, integer=True)
            if self.prompt_logprobs < 0:
                raise SamplingParamError("prompt_logprobs", "must be >= 0")
        if self.seed is not None:
            _check_number("seed", self.seed, integer=True)
        if (
            self.max_tokens is not None
            and self.min_tokens is not None
            and self.min_tokens > self.max_tokens
        ):
            raise SamplingParamError("min_tokens", "must not exceed max_tokens")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise SamplingParamError("stop", "must be a non-empty string or list of them")
        for tid in self.stop_token_ids or []:
            _check_number("stop_token_ids", tid, integer=True)


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
    max_tokens: int
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sampling_dict(self) -> dict[str, Any]:
        """The layered fields, for the `sampling.effective` object."""
        return {name: getattr(self, name) for name in LAYERED_FIELDS} | {
            "max_tokens": self.max_tokens,
            "seed": self.seed,
        }
