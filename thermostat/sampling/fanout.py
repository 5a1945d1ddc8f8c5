"""A request planned once, at the edge: every choice's resolution fitted to its prompt.

`n` samples of each prompt are each their own engine request (a choice), with their own random
stream and their prompt's room in the context. `serve`, the PD decode and `LLM.generate` plan a
request here and hand the plan to the engine, which runs exactly what it says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from thermostat.sampling.resolve import Resolution, fit_to_context


@dataclass(frozen=True)
class Plan:
    """Choice i * n + j is sample j of prompt i; it runs with `choices[i * n + j]`."""

    prompts: tuple[tuple[int, ...], ...]  # token ids
    n: int
    choices: tuple[Resolution, ...]

    def prompt_of(self, index: int) -> tuple[int, ...]:
        return self.prompts[index // self.n]


def per_sample(resolution: Resolution, n: int) -> list[Resolution]:
    """The resolution of each of `n` samples. Sample j of a seeded request gets seed + j, so the
    samples differ from each other and each is reproducible; unseeded samples share the
    resolution as is."""
    seed = resolution.effective.seed
    if seed is None:
        return [resolution] * max(n, 1)
    effective = [dataclasses.replace(resolution.effective, seed=seed + j) for j in range(1, n)]
    return [resolution, *(dataclasses.replace(resolution, effective=e) for e in effective)]


def plan(
    resolution: Resolution,
    prompts: Sequence[Sequence[int]],
    context_len: int,
    n: int = 1,
    cap_sent: bool = False,
) -> Plan:
    """Every choice's resolution, in index order: fitted to its prompt (`fit_to_context`, which
    may refuse; `cap_sent`: a sent max_tokens is cut to the room), then `per_sample`."""
    choices = [
        child
        for prompt in prompts
        for child in per_sample(fit_to_context(resolution, len(prompt), context_len, cap_sent), n)
    ]
    return Plan(tuple(tuple(p) for p in prompts), n, tuple(choices))
