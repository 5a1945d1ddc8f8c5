"""The server-side layers of one model, built from what the operator said and the model ships."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from thermostat.sampling.recommendations import recommendation_for
from thermostat.sampling.resolve import Policy, SamplingDefaults


def build_sampling_defaults(
    generation_config: Mapping[str, Any],
    config_dict: Mapping[str, Any],
    operator: Mapping[str, Any] | str | None,
    policy: Policy,
) -> SamplingDefaults:
    """Operator values (or the word "recommended" to opt in to the family's published values)
    over the values the model's generation_config.json sets. Raises ValueError for an unknown
    family under "recommended" or a value no request could carry."""
    recommended = None
    if operator == "recommended":
        rec = recommendation_for(dict(config_dict))
        if rec is None:
            raise ValueError("no published recommendation is known for this model's family")
        recommended, operator = rec.values, None
    elif isinstance(operator, str):
        raise ValueError(f"sampling defaults must be a dict or 'recommended', got {operator!r}")
    return SamplingDefaults(
        operator=dict(operator or {}),
        recommended=recommended,
        generation_config=dict(generation_config),
        policy=policy,
    )
