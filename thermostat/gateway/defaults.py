"""The gateway's layers and the resolution of one request, with the upstream as a layer.

Layers, highest first (the first that sets a field wins):

| source            | from                                                           |
|-------------------|----------------------------------------------------------------|
| request           | the client's body                                              |
| operator          | the gateway's --sampling-defaults                              |
| recommended       | the family's values, when the operator opts in                 |
| generation_config | --generation-config / --model, or the upstream's report of it  |
| upstream          | the upstream's own defaults as it reports them (llama.cpp /props) |
| builtin           | neutral values; only when the model's generation_config is known |

When the generation_config is not known, a field no layer sets is left to the upstream: its
source is `upstream`, its effective value `null`, and it is not sent. Every other value is sent
explicitly, so the upstream's defaults decide nothing silently.

`max_tokens` comes from the client, else the operator's cap (`--sampling-defaults max_tokens=N`),
and is sent; with neither it is not sent (source `upstream`, value `null`): the upstream runs the
answer to the end of its context, as `serve` does.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from thermostat.api.defaults import DefaultsReport
from thermostat.gateway.discovery import UpstreamInfo
from thermostat.gateway.kinds import KINDS, UpstreamKind
from thermostat.sampling import (
    LAYERED_FIELDS,
    Adjustment,
    Policy,
    Resolution,
    SamplingDefaults,
    SamplingParamError,
    SamplingParams,
    resolve,
)
from thermostat.sampling.defaults import build_sampling_defaults
from thermostat.sampling.fields import BUILTIN
from thermostat.sampling.generation_config import GenerationConfigDefaults
from thermostat.sampling.recommendations import recommendation_for


@dataclass(frozen=True)
class UpstreamLayered(SamplingDefaults):
    """SamplingDefaults with the upstream's reported defaults between generation_config and
    builtin."""

    upstream: Mapping[str, Any] = field(default_factory=dict)

    def layers(self) -> list[tuple[str, Mapping[str, Any]]]:
        *above, builtin = super().layers()
        return [*above, ("upstream", self.upstream), builtin]


@dataclass(frozen=True)
class Resolved:
    """One request's resolution as the gateway applies it: `unknown` fields are the
    upstream's to decide (not sent)."""

    resolution: Resolution
    unknown: frozenset[str] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        """The `sampling` object of a response."""
        out = self.resolution.to_dict()
        for name in self.unknown:
            out["effective"][name] = None
            out["source"][name] = "upstream"
        return out

    def choice(self, index: int, n: int, kind: UpstreamKind) -> dict[str, Any]:
        """The `sampling` of choice `index` of a request for `n` samples per prompt: sample
        j = index % n of a seeded request ran on seed + j where the kind does that
        (kinds.py); elsewhere a later sample's seed is the upstream's (null)."""
        out = self.to_dict()
        seed, j = self.resolution.effective.seed, index % max(n, 1)
        if seed is not None and j:
            out["effective"]["seed"] = seed + j if kind.seeds_samples else None
            if not kind.seeds_samples:
                out["source"]["seed"] = "upstream"
        return out

    def sent(self, kind: UpstreamKind) -> dict[str, Any]:
        """The layered fields, max_tokens and seed as the upstream names them (unknown ones
        left out)."""
        eff = self.resolution.effective
        names = [*LAYERED_FIELDS, "max_tokens"]
        values = {n: getattr(eff, n) for n in names if n not in self.unknown}
        if eff.seed is not None:
            values["seed"] = eff.seed
        pairs = [kind.wire(n, v) for n, v in values.items() if kind.supports(n)]
        return dict(pairs)


@dataclass(frozen=True)
class GatewayDefaults:
    info: UpstreamInfo
    report: DefaultsReport  # the layers and the report, as `serve` makes them
    kind: UpstreamKind

    @classmethod
    def build(
        cls,
        info: UpstreamInfo,
        operator: dict[str, Any] | str | None,
        policy: Policy,
    ) -> GatewayDefaults:
        """Raises ValueError for a `recommended` without a known family."""
        gen = info.generation_config or GenerationConfigDefaults(path=None)
        base = build_sampling_defaults(gen.values, info.model_config, operator, policy)
        layered = UpstreamLayered(
            operator=base.operator,
            recommended=base.recommended,
            generation_config=base.generation_config,
            policy=policy,
            upstream=dict(info.reported),
        )
        report = DefaultsReport(info.model, layered, gen, recommendation_for(info.model_config))
        return cls(info, report, KINDS[info.kind])

    @property
    def known(self) -> bool:
        """The model's generation_config.json is known (so builtin values apply)."""
        return self.info.generation_config is not None

    def resolve(self, params: SamplingParams) -> Resolved:
        """Resolve as `serve` does, then leave unknown fields to the upstream and drop what
        the kind cannot take (400 if the client sent it, else an adjustment)."""
        resolution = resolve(params, self.report.layers)
        unknown = {n for n, s in resolution.source.items() if s == "builtin" and not self.known}
        if resolution.source["max_tokens"] == "context_length":
            unknown.add("max_tokens")  # neither the client nor the operator: the upstream's
        return Resolved(self._supported(resolution, params), frozenset(unknown))

    def _supported(self, resolution: Resolution, params: SamplingParams) -> Resolution:
        eff, dropped, adjusted = resolution.effective, {}, list(resolution.adjusted)
        refused = f"the upstream ({self.kind.name}) does not support it"
        for name in LAYERED_FIELDS:
            value = getattr(eff, name)
            if self.kind.supports(name) or self.kind.neutral(name, value):
                continue
            if resolution.source[name] == "request":
                raise SamplingParamError(name, refused)
            dropped[name] = BUILTIN[name]
            adjusted.append(Adjustment(name, value, BUILTIN[name], "upstream_unsupported"))
        for name in sorted(self.kind.unsupported - set(LAYERED_FIELDS)):
            if getattr(params, name, None) not in (None, False):
                raise SamplingParamError(name, refused)
        if not dropped:
            return resolution
        return dataclasses.replace(
            resolution,
            effective=dataclasses.replace(eff, **dropped),
            adjusted=tuple(adjusted),
        )

    def baseline(self) -> Resolved:
        return self.resolve(SamplingParams())

    def warnings(self) -> list[str]:
        return [text for _, text in self.findings()]

    def findings(self) -> list[tuple[str, str]]:
        """serve's, plus what the gateway cannot see (each with its kind)."""
        found = self.report.findings()
        base = self.baseline()
        layered = base.unknown - {"max_tokens"}
        if layered:
            names = ", ".join(sorted(layered))
            found.insert(0, (
                "upstream_defaults_unknown",
                f"the gateway does not know the upstream's defaults for {names}: requests that "
                "omit them get what the upstream decides (source 'upstream'); give "
                "--generation-config PATH or --model DIR, or set them with --sampling-defaults",
            ))  # fmt: skip
            policy = self.report.layers.policy
            if "temperature" in layered and policy.min_temperature is not None:
                found.append((
                    "min_temperature_unseen",
                    "--min-temperature applies to temperatures the gateway resolves; one "
                    "omitted and left to the upstream is not seen",
                ))  # fmt: skip
        return found

    def to_dict(self) -> dict[str, Any]:
        """The body of GET /v1/sampling/defaults (serve's, plus `upstream`)."""
        out = self.report.to_dict()
        sampling = self.baseline().to_dict()
        out.update(
            effective=sampling["effective"], source=sampling["source"],
            adjusted=sampling["adjusted"], warnings=self.warnings(),
        )  # fmt: skip
        if not self.known:
            out["generation_config"] = None
        out["upstream"] = {
            "kind": self.info.kind,
            "reported": dict(self.info.reported),
            "generation_config_known": self.known,
            "context_len": self.info.context_len,
            "notes": list(self.info.notes),
        }
        return out

    def render_table(self) -> str:
        base = self.baseline().to_dict()
        table = Table(title=f"Sampling defaults for {self.info.model} via a {self.info.kind} "
                      "upstream (requests that omit a field)")  # fmt: skip
        for column in ("parameter", "effective", "source", "sent upstream"):
            table.add_column(column)
        for name in LAYERED_FIELDS:
            value = base["effective"][name]
            sent = "no (the upstream decides)" if value is None else "yes"
            if not self.kind.supports(name):
                sent = f"no ({self.kind.name} lacks it)"
            table.add_row(name, "unknown" if value is None else str(value),
                          base["source"][name], sent)  # fmt: skip
        if base["effective"]["max_tokens"] is not None:
            table.add_row("max_tokens", str(base["effective"]["max_tokens"]), "operator", "yes")
        else:
            ctx = self.info.context_len
            limit = f" (its context: {ctx})" if ctx else ""
            table.add_row("max_tokens", "unknown", "upstream", f"no (the upstream's limit{limit})")
        policy = self.report.layers.policy
        table.caption = f"policy: min_temperature={policy.min_temperature}, greedy={policy.greedy}"
        console = Console(file=io.StringIO(), width=110, color_system=None)
        console.print(table)
        return console.file.getvalue()  # type: ignore[attr-defined]
