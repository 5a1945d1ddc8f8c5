"""`n` samples of each prompt of one request: each its own engine request (a choice), with its
own random stream and its prompt's room in the context."""

from __future__ import annotations

import dataclasses

from thermostat.sampling.resolve import Resolution, fit_to_context


def per_sample(resolution: Resolution, n: int) -> list[Resolution]:
    """The resolution of each of `n` samples. Sample j of a seeded request gets seed + j, so the
    samples differ from each other and each is reproducible; unseeded samples share the
    resolution as is."""
    children = [resolution]
    for j in range(1, n):
        seed = resolution.effective.seed
        if seed is None:
            children.append(resolution)
        else:
            effective = dataclasses.replace(resolution.effective, seed=seed + j)
            children.append(dataclasses.replace(resolution, effective=effective))
    return children


def choice_resolutions(
    resolution: Resolution,
    max_tokens_sent: bool,
    prompt_lens: list[int],
    context_len: int,
    n: int,
) -> list[Resolution]:
    """The resolution of every choice, in index order (choice i * n + j is sample j of prompt
    i): fitted to its prompt (`fit_to_context`, which may refuse), then `per_sample`."""
    return [
        child
        for prompt_len in prompt_lens
        for child in per_sample(
            fit_to_context(resolution, max_tokens_sent, prompt_len, context_len), n
        )
    ]
