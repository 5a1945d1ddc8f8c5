"""Sampling parameters, their layered resolution with provenance, and policies. No torch here:
the gateway uses this package without an engine."""

from __future__ import annotations

from thermostat.sampling.fields import (
    FIELDS,
    LAYERED_FIELDS,
    Bound,
    SamplingField,
    SamplingParamError,
)
from thermostat.sampling.params import EffectiveParams, SamplingParams
from thermostat.sampling.resolve import (
    Adjustment,
    GreedyRejected,
    Policy,
    Resolution,
    SamplingDefaults,
    resolve,
)

__all__ = [
    "FIELDS",
    "LAYERED_FIELDS",
    "Adjustment",
    "Bound",
    "EffectiveParams",
    "GreedyRejected",
    "Policy",
    "Resolution",
    "SamplingDefaults",
    "SamplingField",
    "SamplingParamError",
    "SamplingParams",
    "resolve",
]
