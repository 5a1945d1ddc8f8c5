"""The sampling fields: one table, from which every other list of them is derived.

| derived from `FIELDS`                         | where                                         |
|-----------------------------------------------|-----------------------------------------------|
| validation (`SamplingField.check`)            | SamplingParams.validate, validate_layered     |
| `LAYERED_FIELDS`, `BUILTIN`                   | here; the resolver's layers                   |
| `--sampling-defaults k=v` parsing             | sampling/spec.py (`SamplingField.parse`)      |
| the request bodies' sampling fields           | server/protocol.py (`_GenerationRequest`)     |
| request body -> SamplingParams                | server/request_params.py                      |
| the sampler's per-row columns and dtypes      | engine/sampler.py (`SamplingBatch.of`)        |
| the keys of `sampling.effective`              | EffectiveParams.sampling_dict                 |

SamplingParams, EffectiveParams and SamplingBatch still declare their fields, for readers and
type checkers; tests/test_fields.py checks those declarations against this table. Adding a
parameter is one entry here, one declaration line in each of those classes, and its math.
No torch here: dtypes are names, which engine/ maps to torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import GenericAlias
from typing import Any, Literal

from thermostat.errors import InvalidRequest

INT64 = (-(2**63), 2**63 - 1)  # integers become int64 tensors / generator seeds in the engine

_NOUN = {float: "a number", int: "an integer", bool: "a boolean", str: "a non-empty string"}


class SamplingParamError(InvalidRequest):
    """A sampling value out of range or of the wrong type; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(param, f"{param}: {message}")


@dataclass(frozen=True)
class Bound:
    """One end of a field's range; `value` itself is inside when `closed`."""

    value: float
    closed: bool = True


@dataclass(frozen=True)
class SamplingField:
    """One sampling field: its type, range, builtin value and where it goes."""

    name: str
    type: type  # float, int, bool or str: of the value, or of each item (see `shape`)
    doc: str
    low: Bound | None = None
    high: Bound | None = None
    off: int | None = None  # a value outside the range that also means "off" (top_k -1)
    note: str = ""  # said after the range in the error message, e.g. "(0 = greedy)"
    neutral: Any = None  # the builtin value an unset field takes; None = unset stays unset
    layered: bool = False  # resolved request > operator > recommended > generation_config > builtin
    reported: bool = False  # in `sampling.effective` though per-request (layered fields always)
    batch_dtype: str | None = None  # "float32" | "int64": a per-row tensor of the sampler
    shape: Literal["one", "list", "one_or_list"] = "one"
    body: bool = True  # in both endpoints' bodies as is (False: endpoint-specific shapes)
    effective: bool = True  # carried by EffectiveParams (False: `n` is fanned out before)
    aliases: tuple[str, ...] = ()  # other body fields for this one; an alias sent wins

    @property
    def annotation(self) -> Any:
        """The Python type of a set value (request models add `| None`)."""
        if self.shape == "list":
            return GenericAlias(list, self.type)
        if self.shape == "one_or_list":
            return self.type | GenericAlias(list, self.type)
        return self.type

    @property
    def expected(self) -> str:
        """What a value must be, in words: "an integer", "a non-empty string or list of them"."""
        noun = _NOUN[self.type]
        return f"{noun} or list of them" if self.shape == "one_or_list" else noun

    @property
    def range_text(self) -> str:
        """The range in words: "in [0, 2] (0 = greedy)", ">= 1", "-1 (off) or >= 1"."""
        low, high = self.low, self.high
        if low and high:
            text = f"in {'[' if low.closed else '('}{low.value:g}, {high.value:g}"
            text += "]" if high.closed else ")"
        elif low:
            text = f"{'>=' if low.closed else '>'} {low.value:g}"
        elif high:
            text = f"{'<=' if high.closed else '<'} {high.value:g}"
        else:
            text = "finite"
        if self.off is not None:
            text = f"{self.off} (off) or {text}"
        return f"{text} {self.note}" if self.note else text

    def in_range(self, value: float) -> bool:
        """Inside the bounds (or the `off` value). NaN and +-inf are never inside."""
        if self.off is not None and value == self.off:
            return True
        low, high = self.low, self.high
        return (
            math.isfinite(value)
            and (low is None or (low.value <= value if low.closed else low.value < value))
            and (high is None or (value <= high.value if high.closed else value < high.value))
        )

    def check(self, value: Any) -> None:
        """Raise SamplingParamError (naming this field) unless `value` is a valid setting."""
        if self.shape == "one":
            self._check_item(value)
            return
        if self.shape == "one_or_list" and isinstance(value, self.type):
            value = [value]
        if not isinstance(value, list | tuple):
            what = self.expected if self.shape == "one_or_list" else "a list"
            raise SamplingParamError(self.name, f"must be {what}, got {value!r}")
        for item in value:
            self._check_item(item)

    def _check_item(self, value: Any) -> None:
        if self.type is bool:
            ok = isinstance(value, bool)
        elif self.type is str:
            ok = isinstance(value, str) and value != ""
        else:
            kinds = (int,) if self.type is int else (int, float)
            ok = isinstance(value, kinds) and not isinstance(value, bool)
        if not ok:
            raise SamplingParamError(self.name, f"must be {self.expected}, got {value!r}")
        if self.type is int and not INT64[0] <= value <= INT64[1]:
            raise SamplingParamError(self.name, f"must fit a signed 64-bit integer, got {value}")
        if self.type in (int, float) and not self.in_range(value):
            raise SamplingParamError(self.name, f"must be {self.range_text}, got {value}")

    def parse(self, text: str) -> Any:
        """A number field's value from text (`--sampling-defaults top_k=20`); ValueError if not
        one. Not validated: call `check`."""
        if self.type not in (int, float):
            raise ValueError(f"{self.name} is not a number field")
        return self.type(text)


_ZERO, _ONE, _ABOVE_ZERO = Bound(0.0), Bound(1.0), Bound(0.0, closed=False)
_FLOAT, _INT = "float32", "int64"

# In the order of SamplingParams; the layered fields first, in the order of `sampling.effective`.
# fmt: off
FIELDS: tuple[SamplingField, ...] = (
    SamplingField("temperature", float, "divides the logits; 0 = greedy (argmax)",
                  layered=True, neutral=1.0, batch_dtype=_FLOAT,
                  low=_ZERO, high=Bound(2.0), note="(0 = greedy)"),
    SamplingField("top_p", float, "keep the smallest set of top tokens with this probability",
                  layered=True, neutral=1.0, batch_dtype=_FLOAT, low=_ABOVE_ZERO, high=_ONE),
    SamplingField("top_k", int, "keep the k most probable tokens; -1 = off",
                  layered=True, neutral=-1, batch_dtype=_INT, low=Bound(1), off=-1),
    SamplingField("min_p", float, "drop tokens below min_p x the top token's probability",
                  layered=True, neutral=0.0, batch_dtype=_FLOAT, low=_ZERO, high=_ONE),
    SamplingField("repetition_penalty", float,
                  "HF/vLLM: shrink logits of tokens seen in the prompt or output; 1 = off",
                  layered=True, neutral=1.0, batch_dtype=_FLOAT,
                  low=_ABOVE_ZERO, high=Bound(10.0), note="(1 = off)"),
    SamplingField("frequency_penalty", float, "OpenAI: logit -= f x the token's output count",
                  layered=True, neutral=0.0, batch_dtype=_FLOAT,
                  low=Bound(-2.0), high=Bound(2.0)),
    SamplingField("presence_penalty", float, "OpenAI: logit -= p if the token is in the output",
                  layered=True, neutral=0.0, batch_dtype=_FLOAT,
                  low=Bound(-2.0), high=Bound(2.0)),
    SamplingField("dry_multiplier", float,
                  "llama.cpp's DRY: logit -= m x base^(n - allowed) for the token that would "
                  "extend a repeat of n tokens; 0 = off",
                  layered=True, neutral=0.0, batch_dtype=_FLOAT, low=_ZERO, high=Bound(100.0),
                  note="(0 = off)"),
    SamplingField("dry_base", float, "DRY: the penalty's growth per repeated token",
                  layered=True, neutral=1.75, batch_dtype=_FLOAT,
                  low=Bound(1.0, closed=False), high=Bound(10.0)),
    SamplingField("dry_allowed_length", int, "DRY: repeats this long go unpenalised",
                  layered=True, neutral=2, batch_dtype=_INT, low=Bound(1), high=Bound(1024)),
    SamplingField("dry_penalty_last_n", int,
                  "DRY: the last this many tokens of prompt and output are searched; -1 = all",
                  layered=True, neutral=-1, batch_dtype=_INT, low=Bound(-1),
                  note="(-1 = the whole context)"),
    SamplingField("xtc_probability", float,
                  "llama.cpp's XTC: the chance per token of excluding the top choices; 0 = off",
                  layered=True, neutral=0.0, batch_dtype=_FLOAT, low=_ZERO, high=_ONE,
                  note="(0 = off)"),
    SamplingField("xtc_threshold", float,
                  "XTC: every token at least this probable but the least of them is excluded",
                  layered=True, neutral=0.1, batch_dtype=_FLOAT, low=_ZERO, high=_ONE),
    SamplingField("max_tokens", int,
                  "tokens to generate at most; unset = the operator's cap, else the context's room",
                  low=_ZERO, reported=True, aliases=("max_completion_tokens",)),
    SamplingField("min_tokens", int, "EOS and stop token ids are banned before this many",
                  neutral=0, low=_ZERO),
    SamplingField("n", int, "samples per prompt, each its own engine request",
                  neutral=1, low=Bound(1), effective=False),
    SamplingField("seed", int, "the request's own random stream; unset = the shared one",
                  reported=True),
    SamplingField("stop", str, "strings that end the text (not included in it)",
                  neutral=(), shape="one_or_list"),
    SamplingField("stop_token_ids", int, "token ids that end the generation",
                  neutral=(), shape="list"),
    SamplingField("dry_sequence_breakers", str,
                  "DRY: a repeat does not extend across a token whose text holds one of these",
                  neutral=("\n", ":", '"', "*"), shape="list"),
    SamplingField("ignore_eos", bool, "keep generating past EOS", neutral=False),
    SamplingField("logprobs", int, "the chosen token's logprob and this many alternatives",
                  low=_ZERO, body=False),
    SamplingField("prompt_logprobs", int, "the prompt tokens' logprobs, with alternatives",
                  low=_ZERO, body=False),
    SamplingField("skip_special_tokens", bool, "leave special tokens out of the text",
                  neutral=True),
)
# fmt: on

FIELD: dict[str, SamplingField] = {f.name: f for f in FIELDS}

# Fields resolved through the layers request > operator > recommended > generation_config >
# builtin. The other fields belong to one request only and take their neutral value when unset.
LAYERED_FIELDS: tuple[str, ...] = tuple(f.name for f in FIELDS if f.layered)

# What an operator may default (`--sampling-defaults`): the layered fields, and max_tokens, a cap
# on requests that omit it (without one they run to the end of the context).
OPERATOR_FIELDS: tuple[str, ...] = (*LAYERED_FIELDS, "max_tokens")

# Neutral OpenAI-style values: the `builtin` layer.
BUILTIN: dict[str, Any] = {f.name: f.neutral for f in FIELDS if f.layered}

# The keys of a response's `sampling.effective` object, in order.
REPORTED_FIELDS: tuple[str, ...] = tuple(f.name for f in FIELDS if f.layered or f.reported)

# The sampler's per-row inputs: one SamplingBatch column each.
BATCH_FIELDS: tuple[SamplingField, ...] = tuple(f for f in FIELDS if f.batch_dtype)


def check_operator(name: str, value: Any) -> None:
    """Raise SamplingParamError unless `value` is a valid operator default of field `name`
    (an operator's max_tokens caps answers, so it must allow one token)."""
    if name not in OPERATOR_FIELDS:
        raise SamplingParamError(name, "is not a field an operator can default")
    FIELD[name].check(value)
    if name == "max_tokens" and value < 1:
        raise SamplingParamError(name, f"an operator default must be >= 1, got {value}")
