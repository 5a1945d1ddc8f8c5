"""Parse the operator's `--sampling-defaults SPEC`.

| SPEC                          | meaning                                                   |
|-------------------------------|-----------------------------------------------------------|
| `temperature=0.6,top_p=0.95`  | operator values for the layered fields named (and max_tokens) |
| `path/to/defaults.json`       | a JSON object of the same keys                            |
| `recommended`                 | opt in to the model family's published values             |

Values are checked with the sampling package's own validation, so the server refuses at startup
what a request would be refused for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from thermostat.sampling.fields import FIELD, OPERATOR_FIELDS, SamplingParamError, check_operator


class SpecError(ValueError):
    """An invalid --sampling-defaults SPEC; the message says what and where."""


def parse_sampling_spec(spec: str | None) -> dict[str, Any] | str | None:
    """Operator values as a dict, the word "recommended", or None when no SPEC was given."""
    if spec is None or not spec.strip():
        return None
    spec = spec.strip()
    if spec == "recommended":
        return "recommended"
    path = Path(spec).expanduser()
    if path.suffix == ".json" or path.is_file():
        return _validated(_read_json(path), f"{path}: ")
    return _validated(_parse_pairs(spec), "")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise SpecError(f"sampling defaults file not found: {path}") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(raw, dict):
        raise SpecError(f'{path}: expected a JSON object such as {{"temperature": 0.6}}')
    return raw


def _parse_pairs(spec: str) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for item in spec.split(","):
        key, sep, text = (part.strip() for part in item.partition("="))
        if not sep or not key or not text:
            raise SpecError(
                f"expected key=value pairs such as temperature=0.6,top_p=0.95, a JSON file or "
                f"'recommended'; got {item.strip()!r}"
            )
        if key in values:
            raise SpecError(f"{key} is given twice")
        _check_known(key, "")
        try:
            values[key] = FIELD[key].parse(text)
        except ValueError as exc:
            raise SpecError(f"{key} must be {FIELD[key].expected}, got {text!r}") from exc
    return values


def _check_known(key: str, where: str) -> None:
    if key not in OPERATOR_FIELDS:
        raise SpecError(
            f"{where}unknown sampling field {key!r}; known: {', '.join(OPERATOR_FIELDS)}"
        )


def _validated(values: dict[str, Any], where: str) -> dict[str, Any]:
    for key, value in values.items():
        _check_known(key, where)
        try:
            check_operator(key, value)
        except SamplingParamError as exc:
            raise SpecError(f"{where}{exc}") from exc
    return values
