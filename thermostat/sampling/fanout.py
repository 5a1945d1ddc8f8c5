"""`n` samples of one request: each its own engine request, with its own random stream."""

from __future__ import annotations

import dataclasses

from thermostat.sampling.resolve import Resolution


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
