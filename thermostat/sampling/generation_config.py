"""Read the sampling keys a model directory's generation_config.json actually sets.

transformers' GenerationConfig fills in defaults (top_k=50, temperature=1.0, ...) that are not in
the file; a server that trusts those reports values nobody chose. We parse the JSON ourselves.

`do_sample: false` is not turned into greedy decoding: model files often carry it by accident
next to real sampling values, and a server must not go greedy silently (the case study). The
flag is reported, and the startup report warns about it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thermostat.sampling.fields import LAYERED_FIELDS, SamplingParamError
from thermostat.sampling.params import validate_layered

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
    """Parse `model_dir/generation_config.json` (or `model_dir` itself when it is a file, as
    the gateway's --generation-config names one); a missing file gives empty defaults."""
    path = Path(model_dir)
    if not path.is_file():
        path = path / FILENAME
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


@dataclass(frozen=True)
class GenerationConfigChange:
    """What `update_generation_config` did."""

    path: Path
    backup: Path | None  # the previous file, or None when there was none
    before: dict[str, Any]
    after: dict[str, Any]

    @property
    def changed(self) -> dict[str, tuple[Any, Any]]:
        keys = sorted(set(self.before) | set(self.after))
        return {
            k: (self.before.get(k), self.after.get(k))
            for k in keys
            if self.before.get(k) != self.after.get(k)
        }


def update_generation_config(
    model_dir: str | Path, updates: dict[str, Any]
) -> GenerationConfigChange:
    """Set sampling keys in `model_dir/generation_config.json`, as the case study's fix did.

    Every value is validated before anything is written. The old file is kept as
    `generation_config.json.bak`; the new one is written to a temporary file and renamed over
    the old, so a crash never leaves a half-written file. Setting a temperature > 0 also sets
    `do_sample: true`, since transformers ignores sampling values without it."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"model directory not found: {model_dir}")
    for name, value in updates.items():
        if name not in LAYERED_FIELDS:
            raise SamplingParamError(name, "is not a sampling field")
        validate_layered(name, value)
    path = model_dir / FILENAME
    before: dict[str, Any] = {}
    if path.is_file():
        try:
            before = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc}); fix or remove it first") from exc
    after = dict(before) | updates
    if updates.get("temperature", 0) > 0:
        after["do_sample"] = True
    backup = None
    if path.is_file():
        backup = path.with_name(FILENAME + ".bak")
        backup.write_bytes(path.read_bytes())
    tmp = path.with_name(f".{FILENAME}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(after, indent=2) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return GenerationConfigChange(path=path, backup=backup, before=before, after=after)
