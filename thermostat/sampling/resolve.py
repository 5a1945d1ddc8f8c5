"""Layered resolution of sampling parameters with provenance, then policies.

Layers, highest first; the first layer that sets a field wins:

| source              | what it is                                                        |
|---------------------|-------------------------------------------------------------------|
| request             | a field the client sent (None = not sent)                         |
| operator            | `--sampling-defaults` / `LLM(sampling_defaults=...)`              |
| recommended         | the model family's published values; only when the operator opts in |
| generation_config   | keys the model directory's generation_config.json actually sets   |
| builtin             | neutral OpenAI-style values                                       |

Policies run after the layers, each recorded as an Adjustment: min_temperature raises any lower
temperature (an explicit 0 included); greedy="reject" refuses an explicit temperature 0.
`max_tokens` comes from the request, else the operator (a cap), else it is the room the prompt
leaves in the context (source `context_length`, value null until the prompt is known). Once the
prompt is tokenized, `fit_to_context` sets that room, or lowers an operator's cap to it (an
Adjustment, policy "context_length"): the engine runs exactly what the resolution says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from thermostat.errors import InvalidRequest
from thermostat.sampling.fields import (
    BUILTIN,
    FIELD,
    LAYERED_FIELDS,
    SamplingParamError,
    check_operator,
)
from thermostat.sampling.params import EffectiveParams, SamplingParams, validate_layered


class GreedyRejected(InvalidRequest):
    """An explicit temperature 0 under the `--greedy reject` policy."""

    code = "greedy_rejected"

    def __init__(self, message: str) -> None:
        super().__init__("temperature", message)


@dataclass(frozen=True)
class Policy:
    """Operator policies applied after the layers."""

    min_temperature: float | None = None
    greedy: Literal["allow", "reject"] = "allow"

    def __post_init__(self) -> None:
        if self.greedy not in ("allow", "reject"):
            raise ValueError(f"greedy policy must be 'allow' or 'reject', got {self.greedy!r}")
        if self.min_temperature is not None:
            validate_layered("temperature", self.min_temperature)


@dataclass(frozen=True)
class Adjustment:
    """A policy changed a resolved value."""

    param: str
    requested: Any
    applied: Any
    policy: str


@dataclass(frozen=True)
class SamplingDefaults:
    """The server-side layers and policies, fixed at startup."""

    operator: Mapping[str, Any] = field(default_factory=dict)
    recommended: Mapping[str, Any] | None = None  # None: the operator did not opt in
    generation_config: Mapping[str, Any] = field(default_factory=dict)
    policy: Policy = field(default_factory=Policy)

    def __post_init__(self) -> None:
        for name, value in self.operator.items():
            check_operator(name, value)
        for layer in (self.recommended or {}, self.generation_config):
            for name, value in layer.items():
                if name not in LAYERED_FIELDS:
                    raise ValueError(f"unknown sampling field {name!r}")
                validate_layered(name, value)

    def layers(self) -> list[tuple[str, Mapping[str, Any]]]:
        """Server-side layers, highest first (the request layer is added by `resolve`)."""
        return [
            ("operator", self.operator),
            ("recommended", self.recommended or {}),
            ("generation_config", self.generation_config),
            ("builtin", BUILTIN),
        ]


@dataclass(frozen=True)
class Resolution:
    """Effective parameters, the source of each layered field and of max_tokens, and policy
    adjustments."""

    effective: EffectiveParams
    source: dict[str, str]
    adjusted: tuple[Adjustment, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The `sampling` extension object of a response; `constraint` only when the output is
        constrained (StructuredOutput.to_dict: kind, source field, hash)."""
        out = {
            "effective": self.effective.sampling_dict(),
            "source": dict(self.source),
            "adjusted": [vars(a) | {} for a in self.adjusted],
        }
        if self.effective.structured is not None:
            out["constraint"] = self.effective.structured.to_dict()
        return out


def resolve_layers(
    request: Mapping[str, Any], defaults: SamplingDefaults
) -> tuple[dict[str, Any], dict[str, str]]:
    """First layer that sets each field wins; returns (values, source)."""
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    for name in LAYERED_FIELDS:
        for layer_name, layer in [("request", request), *defaults.layers()]:
            if layer.get(name) is not None:
                values[name] = layer[name]
                source[name] = layer_name
                break
    return values, source


def apply_policy(
    values: dict[str, Any], source: dict[str, str], policy: Policy
) -> list[Adjustment]:
    """Apply min_temperature, then the greedy policy; mutate `values`, return adjustments."""
    adjusted: list[Adjustment] = []
    temperature = values["temperature"]
    if policy.min_temperature is not None and temperature < policy.min_temperature:
        values["temperature"] = policy.min_temperature
        adjusted.append(
            Adjustment("temperature", temperature, policy.min_temperature, "min_temperature")
        )
    elif temperature == 0.0 and source["temperature"] == "request" and policy.greedy == "reject":
        raise GreedyRejected(
            "temperature=0 (greedy decoding) is rejected by this server's policy "
            "(--greedy reject): greedy decoding makes many models loop and repeat. Send a "
            "temperature > 0, or omit it to get the server's defaults (GET /v1/sampling/defaults)."
        )
    return adjusted


def resolve(params: SamplingParams, defaults: SamplingDefaults) -> Resolution:
    """Resolve one request. Raises SamplingParamError for invalid input, GreedyRejected for an
    explicit temperature 0 under greedy="reject"."""
    params.validate()
    values, source = resolve_layers(params.sent(), defaults)
    adjusted = apply_policy(values, source, defaults.policy)
    max_tokens = params.max_tokens
    source["max_tokens"] = "request"
    if max_tokens is None:
        max_tokens = defaults.operator.get("max_tokens")
        source["max_tokens"] = "context_length" if max_tokens is None else "operator"
    stop = params.stop
    effective = EffectiveParams(
        **values,
        max_tokens=max_tokens,
        min_tokens=params.min_tokens or 0,
        seed=params.seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        stop_token_ids=tuple(params.stop_token_ids or ()),
        dry_sequence_breakers=FIELD["dry_sequence_breakers"].neutral
        if params.dry_sequence_breakers is None
        else tuple(params.dry_sequence_breakers),
        ignore_eos=bool(params.ignore_eos),
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        skip_special_tokens=True
        if params.skip_special_tokens is None
        else params.skip_special_tokens,
        structured=params.structured,
        repetition_detection=params.repetition_detection,
    )
    return Resolution(effective=effective, source=source, adjusted=tuple(adjusted))


def fit_to_context(
    resolution: Resolution, prompt_len: int, context_len: int, cap_sent: bool = False
) -> Resolution:
    """The resolution of one prompt of `prompt_len` tokens in a context of `context_len`. An
    omitted max_tokens becomes the room left; an operator's cap larger than the room is lowered
    to it and recorded as an Adjustment (policy "context_length"); a sent one that does not fit
    is refused (SamplingParamError), or with `cap_sent` (the agents' APIs) lowered as an
    operator's is; a prompt that leaves no room to generate is refused."""
    eff = resolution.effective
    room = context_len - prompt_len
    wanted = room if eff.max_tokens is None else eff.max_tokens
    if resolution.source["max_tokens"] == "request" and wanted > room and not cap_sent:
        raise SamplingParamError(
            "max_tokens",
            f"prompt ({prompt_len} tokens) + max_tokens ({wanted}) exceeds the "
            f"context length ({context_len})",
        )
    if room <= 0 and (eff.max_tokens is None or eff.max_tokens > 0):
        what = "exceed" if prompt_len > context_len else "leave no room to generate in"
        raise SamplingParamError(
            "prompt", f"{prompt_len} tokens {what} the context length ({context_len})"
        )
    adjusted = resolution.adjusted
    if eff.max_tokens is not None and eff.max_tokens > room:
        adjusted = (*adjusted, Adjustment("max_tokens", eff.max_tokens, room, "context_length"))
    if eff.max_tokens == min(wanted, room):
        return resolution
    effective = dataclasses.replace(eff, max_tokens=min(wanted, room))
    return dataclasses.replace(resolution, effective=effective, adjusted=adjusted)
