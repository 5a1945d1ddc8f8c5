"""Thermostat: an LLM inference server whose sampling you can see, set and verify."""

from __future__ import annotations

from thermostat.llm import LLM, Completion, GenerationOutput
from thermostat.sampling import SamplingParams

__all__ = ["LLM", "Completion", "GenerationOutput", "SamplingParams"]
