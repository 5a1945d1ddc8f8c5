"""What the gateway learns from its upstream at startup: its kind, its model, its defaults.

| kind       | recognised by (in this order)         | tells about sampling               |
|------------|---------------------------------------|------------------------------------|
| thermostat | GET /v1/sampling/defaults             | generation_config, operator values |
| llamacpp   | GET /props: default_generation_settings | its default for every field      |
| sglang     | GET /get_model_info or /server_info   | the model path only                |
| vllm       | /v1/models cards `owned_by: vllm`     | the model path only (`root`)       |
| openai     | anything else serving /v1/models      | nothing                            |

The context length, where the upstream tells it (the model card's `max_model_len` on vLLM and
Thermostat, llama-server's /props `n_ctx`), is reported at startup: a request that omits
max_tokens may generate up to it.

A model path the upstream names (SGLang's `model_path`, the model card's `root`) that is a
directory readable here gives its generation_config.json and config.json. What is learned
nowhere stays unknown: the gateway leaves those fields to the upstream and says so.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thermostat.gateway.upstream import Upstream
from thermostat.sampling.fields import FIELD, LAYERED_FIELDS, SamplingParamError
from thermostat.sampling.generation_config import (
    GenerationConfigDefaults,
    read_generation_config,
)

log = logging.getLogger("thermostat.gateway")

# llama-server's names of the layered fields, in /props default_generation_settings.params
LLAMACPP_NAMES = {"repeat_penalty": "repetition_penalty"}


@dataclass
class UpstreamInfo:
    """What the upstream told (or what the flags said instead)."""

    kind: str
    models: list[dict[str, Any]] = field(default_factory=list)  # /v1/models cards
    generation_config: GenerationConfigDefaults | None = None  # None: not known
    model_config: dict[str, Any] = field(default_factory=dict)  # config.json, when known
    reported: dict[str, Any] = field(default_factory=dict)  # the upstream's own defaults
    notes: list[str] = field(default_factory=list)  # how each fact was learned, or not
    context_len: int | None = None  # tokens of context, when the upstream tells

    @property
    def model(self) -> str:
        return str(self.models[0]["id"]) if self.models else "unknown"


def _valid(values: dict[str, Any], notes: list[str], where: str) -> dict[str, Any]:
    out = {}
    for name, value in values.items():
        if name not in LAYERED_FIELDS or value is None:
            continue
        if name == "top_k" and isinstance(value, int) and value <= 0:
            value = -1  # llama.cpp and transformers: <= 0 turns top-k off
        if isinstance(value, float):
            value = round(value, 6)  # llama.cpp reports float32s: 0.800000011920929
        try:
            FIELD[name].check(value)
        except SamplingParamError as exc:
            notes.append(f"{where}: {name} ignored ({exc})")
            continue
        out[name] = value
    return out


def _context_len(info: UpstreamInfo, props: Any) -> None:
    """The first context length the model cards or llama-server's /props tell."""
    found: list[Any] = [card.get("max_model_len") for card in info.models]
    if isinstance(props, dict):
        settings = props.get("default_generation_settings")
        found += [props.get("n_ctx"), settings.get("n_ctx") if isinstance(settings, dict) else None]
    sizes = [v for v in found if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    if sizes:
        info.context_len = sizes[0]
        info.notes.append(f"context length {sizes[0]} tokens: a request that omits max_tokens "
                          "may generate up to what its prompt leaves of it")  # fmt: skip
    else:
        info.notes.append("the upstream does not tell its context length")


def _local_model(path: Any, info: UpstreamInfo) -> None:
    """Read generation_config.json and config.json from a model path the upstream named."""
    if not isinstance(path, str) or not path or info.generation_config is not None:
        return
    model_dir = Path(path)
    if not (model_dir / "config.json").is_file():
        info.notes.append(f"the upstream's model path {path} is not readable here")
        return
    info.generation_config = read_generation_config(model_dir)
    info.model_config = json.loads((model_dir / "config.json").read_text())
    info.notes.append(f"generation_config.json read from the upstream's model path {path}")


async def discover(upstream: Upstream, kind: str) -> UpstreamInfo:
    """Ask the upstream; `kind` is a KINDS name or "auto". Raises APIError (502/504) when the
    upstream cannot be reached at all."""
    info = await _discover(upstream, kind)
    props = await upstream.probe("/props") if info.kind == "llamacpp" else None
    _context_len(info, props)
    return info


async def _discover(upstream: Upstream, kind: str) -> UpstreamInfo:
    models = await upstream.models()
    info = UpstreamInfo(kind="openai" if kind == "auto" else kind, models=models)
    if kind in ("auto", "thermostat"):
        report = await upstream.probe("/v1/sampling/defaults")
        if isinstance(report, dict) and isinstance(report.get("effective"), dict):
            info.kind = "thermostat"
            _thermostat(report, info)
            return info
    if kind in ("auto", "llamacpp"):
        props = await upstream.probe("/props")
        if isinstance(props, dict) and "default_generation_settings" in props:
            info.kind = "llamacpp"
            params = props["default_generation_settings"].get("params", {})
            named = {LLAMACPP_NAMES.get(k, k): v for k, v in params.items()}
            info.reported = _valid(named, info.notes, "/props")
            info.notes.append("llama-server reports its defaults for every field (/props)")
            return info
    if kind in ("auto", "sglang"):
        for path in ("/get_model_info", "/server_info"):
            got = await upstream.probe(path)
            if isinstance(got, dict) and "model_path" in got:
                info.kind = "sglang"
                _local_model(got.get("model_path"), info)
                break
    if info.kind == "openai" and any(m.get("owned_by") == "vllm" for m in models):
        info.kind = "vllm"
    for card in models:
        _local_model(card.get("root"), info)
    if info.generation_config is None:
        info.notes.append(
            f"a {info.kind} upstream does not report its model's generation_config.json: "
            "give --generation-config PATH or --model DIR to know it"
        )
    return info


def _thermostat(report: dict[str, Any], info: UpstreamInfo) -> None:
    gen = report.get("generation_config") or {}
    path = gen.get("path")
    info.generation_config = GenerationConfigDefaults(
        path=Path(path) if path else None,
        values=_valid(dict(gen.get("values") or {}), info.notes, "generation_config"),
        do_sample=gen.get("do_sample"),
        ignored=dict(gen.get("ignored") or {}),
    )
    effective, source = report["effective"], report.get("source") or {}
    own = {k: v for k, v in effective.items() if source.get(k) in ("operator", "recommended")}
    info.reported = _valid(own, info.notes, "/v1/sampling/defaults")
    rec = report.get("recommended") or {}
    if rec.get("family"):
        info.model_config = {"thermostat_family": rec["family"]}
    info.notes.append("Thermostat reports its defaults with sources (/v1/sampling/defaults)")
