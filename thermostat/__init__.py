"""Thermostat: an LLM inference server whose sampling you can see, set and verify.

`LLM` (and with it torch) is imported on first use, so the torch-free parts (`sampling`,
`quality`) load without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from thermostat.sampling import SamplingParams

if TYPE_CHECKING:
    from thermostat.llm import LLM, Completion, GenerationOutput

__all__ = ["LLM", "Completion", "GenerationOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "Completion", "GenerationOutput"):
        from thermostat import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'thermostat' has no attribute {name!r}")
