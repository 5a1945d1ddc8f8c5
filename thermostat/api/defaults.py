"""The server's sampling layers for its model, and the report of them: what a request that sends
no sampling fields gets, where each value comes from, and what looks wrong.

Built from config.json and generation_config.json alone (no weights), so a bad
`--sampling-defaults` fails before the model loads. The same object answers
`GET /v1/sampling/defaults` and prints the startup report.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from thermostat.sampling import LAYERED_FIELDS, Policy, Resolution, SamplingDefaults, resolve
from thermostat.sampling.defaults import build_sampling_defaults
from thermostat.sampling.generation_config import (
    GenerationConfigDefaults,
    read_generation_config,
)
from thermostat.sampling.params import SamplingParams
from thermostat.sampling.recommendations import Recommendation, recommendation_for

GENERIC = {"temperature": 1.0, "top_p": 1.0}  # transformers' defaults, chosen by nobody


@dataclass(frozen=True)
class DefaultsReport:
    model: str  # the served model name
    layers: SamplingDefaults  # what resolves requests
    generation_config: GenerationConfigDefaults
    recommendation: Recommendation | None  # the family's, whether or not the operator opted in

    @classmethod
    def for_model(
        cls,
        model_dir: Path,
        served_name: str,
        operator: dict[str, Any] | str | None,
        policy: Policy,
        config_dict: dict[str, Any] | None = None,
    ) -> DefaultsReport:
        """`model_dir`: a model directory, or a one-file model (a GGUF) whose directory may hold
        generation_config.json; `config_dict`: what stands for config.json (default: the
        directory's). Raises ValueError for an invalid layer or a `recommended` without a known
        family."""
        if config_dict is None:
            config_dict = json.loads((model_dir / "config.json").read_text())
        gen = read_generation_config(model_dir.parent if model_dir.is_file() else model_dir)
        defaults = build_sampling_defaults(gen.values, config_dict, operator, policy)
        return cls(served_name, defaults, gen, recommendation_for(config_dict))

    def baseline(self) -> Resolution:
        """The resolution of a request that sends no sampling field."""
        return resolve(SamplingParams(), self.layers)

    def warnings(self) -> list[str]:
        """What an operator should know about these defaults, worst first."""
        return [text for _, text in self.findings()]

    def findings(self) -> list[tuple[str, str]]:
        """The warnings, each with its kind (`thermostat_defaults_warning{kind}`)."""
        base = self.baseline()
        eff, source = base.effective, base.source
        gen = self.generation_config.values
        found: list[tuple[str, str]] = []
        if eff.greedy:
            found.append((
                "greedy_default",
                f"requests that omit temperature get greedy decoding (temperature 0 from "
                f"{source['temperature']}); greedy decoding makes many models loop and repeat",
            ))  # fmt: skip
        rec = self.recommendation
        from_file = source["temperature"] in ("generation_config", "builtin")
        generic = all(gen.get(k, v) == v for k, v in GENERIC.items())
        if rec is not None and self.layers.recommended is None and from_file and generic:
            have = ", ".join(f"{k} {gen[k]}" for k in GENERIC if k in gen) or "none set"
            want = ", ".join(f"{k}={v}" for k, v in rec.values.items())
            found.append((
                "generic_generation_config",
                f"generation_config.json has generic sampling values ({have}) but the "
                f"{rec.family} family recommends {want} ({rec.source}); opt in with "
                f"--sampling-defaults recommended, or set values with --sampling-defaults",
            ))  # fmt: skip
        if self.generation_config.do_sample is False:
            used = ", ".join(f"{k}={v}" for k, v in gen.items()) or "none"
            found.append((
                "do_sample_false",
                "generation_config.json sets do_sample: false. Thermostat ignores do_sample and "
                f"uses the file's values ({used}); omitted fields do not become greedy",
            ))  # fmt: skip
        for key, why in self.generation_config.ignored.items():
            found.append(("ignored_field", f"generation_config.json: {key} ignored ({why})"))
        return found

    def to_dict(self) -> dict[str, Any]:
        """The body of GET /v1/sampling/defaults."""
        base = self.baseline()
        sampling = base.to_dict()
        policy = self.layers.policy
        gen = self.generation_config
        rec = self.recommendation
        return {
            "model": self.model,
            "effective": sampling["effective"],
            "source": sampling["source"],
            "adjusted": sampling["adjusted"],
            "policy": {"min_temperature": policy.min_temperature, "greedy": policy.greedy},
            "operator": dict(self.layers.operator),
            "generation_config": {
                "path": str(gen.path) if gen.path else None,
                "values": dict(gen.values),
                "do_sample": gen.do_sample,
                "ignored": dict(gen.ignored),
            },
            "recommended": None
            if rec is None
            else {
                "family": rec.family,
                "values": dict(rec.values),
                "source": rec.source,
                "applied": self.layers.recommended is not None,
            },
            "warnings": self.warnings(),
        }

    def table(self) -> Table:
        """The startup report: each layered parameter's effective default and its source."""
        base = self.baseline()
        table = Table(title=f"Sampling defaults for {self.model} (requests that omit a field)")
        for column in ("parameter", "effective", "source", "generation_config", "recommended"):
            table.add_column(column)
        rec = self.recommendation.values if self.recommendation else {}
        gen = self.generation_config.values
        for name in LAYERED_FIELDS:
            table.add_row(
                name,
                str(getattr(base.effective, name)),
                base.source[name],
                str(gen.get(name, "-")),
                str(rec.get(name, "-")),
            )
        cap = base.effective.max_tokens
        shown = "prompt's room" if cap is None else str(cap)  # the context's, or the operator's
        table.add_row("max_tokens", shown, base.source["max_tokens"])
        policy = self.layers.policy
        table.caption = (
            f"policy: min_temperature={policy.min_temperature}, greedy={policy.greedy}"
            + "".join(f"; adjusted {a.param} {a.requested}->{a.applied}" for a in base.adjusted)
        )
        return table

    def render_table(self) -> str:
        console = Console(file=io.StringIO(), width=110, color_system=None)
        console.print(self.table())
        return console.file.getvalue()  # type: ignore[attr-defined]
