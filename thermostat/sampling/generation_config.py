"""Read the sampling keys a model directory's generation_config.json actually sets.

transformers' GenerationConfig fills in defaults (top_k=50, temperature=1.0, ...) that are not in
the file; a server that trusts those reports values nobody chose. We parse the JSON ourselves.

`do_sample: false` is not turned into greedy decoding: model files often carry it by accident
next to real sampling values, and a server must not go greedy silently (the case study). The
flag is reported, and the startup report warns about it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thermostat.sampling.params import LAYERED_FIELDS, SamplingParamError, validate_layered

FILENAME = "generation_config.json"


@dataclass(frozen=True)
class GenerationConfigDefaults:
    """Sampling values found in generation_config.json, and what else matters about the file."""

    path: Path | None
    values: dict[str, Any] = field(default_factory=dict)
    do_sample: bool | None = None
    eos_token_ids: tuple[int, ...] = ()
    ignored: dict[str, str] = field(default_factory=dict)  # key -> why it was not used


def read_generation_config(model_dir: str | Path) -> GenerationConfigDefaults:
    """Parse `model_dir/generation_config.json`; a missing file gives empty defaults."""
    path = Path(model_dir) / FILENAME
    if not path.is_file():
        return GenerationConfigDefaults(path=None)
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    values: dict[str, Any] = {}
    ignored: dict[str, str] = {}
    for name in LAYERED_FIELDS:
        if name not in raw or raw[name] is None:
            continue
        value = raw[name]
        if name == "top_k" and value == 0:  # transformers: 0 disables top-k
            value = -1
        try:
            validate_layered(name, value)
        except SamplingParamError as exc:
            ignored[name] = str(exc)
            continue
        values[name] = value
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    do_sample = raw.get("do_sample")
    return GenerationConfigDefaults(
        path=path,
        values=values,
        do_sample=do_sample if isinstance(do_sample, bool) else None,
        eos_token_ids=eos_ids,
        ignored=ignored,
    )
