"""What a prefill hands a decode for one choice, and the check that both would serve it alike.

One choice's handoff (`rooms.PackedHandoff`) is a JSON header and named tensors:

| header key        | what                                                                      |
|-------------------|---------------------------------------------------------------------------|
| `fingerprint`     | what must agree: model, KV cache rows, prompt tokens, resolved sampling   |
| `first_token`     | the first generated token, sampled by the prefill with the full sampling  |
| `first_logprobs`  | its logprobs, when asked for                                              |
| `prompt_logprobs` | the prompt's, when asked for (echo)                                       |

| tensor            | what                                                                      |
|-------------------|---------------------------------------------------------------------------|
| a component name  | `KVRows.tensors`: every prompt token's rows, as the prefill stores them   |
| `generator_state` | the seeded generator after the first token (seeded requests only)         |

The decode recomputes its own fingerprint for the same choice and refuses a handoff whose
fingerprint differs (`disagreements` says how, naming each side's value and source): a prefill
restarted with other sampling defaults, another model file or another KV dtype would otherwise
make the decode continue text it would not have begun.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from thermostat.disagg.rooms import PackedHandoff
from thermostat.engine.steps import Handoff, TokenLogprobs
from thermostat.models.kv_spec import KVRows

GENERATOR = "generator_state"


def model_identity(
    model_dir: Path, architecture: str, dtype: str, weight_format: str
) -> dict[str, str]:
    """The model as two servers can compare it cheaply: architecture, compute dtype, the weight
    format served (int8 on one half and bfloat16 on the other differ in every logit), a hash of
    config.json and one of the weight files' names and sizes (not their bytes: hashing a large
    checkpoint at every start costs minutes). A one-file model (a GGUF) stands for both: its
    first MiB (the metadata's start) and its name and size."""
    if model_dir.is_file():
        with model_dir.open("rb") as f:
            config = hashlib.sha256(f.read(1 << 20)).hexdigest()[:16]
        weights = [(model_dir.name, model_dir.stat().st_size)]
    else:
        config = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:16]
        weights = sorted(
            (p.name, p.stat().st_size)
            for p in model_dir.iterdir()
            if p.suffix in (".safetensors", ".bin", ".pt")
        )
    files = hashlib.sha256(json.dumps(weights).encode()).hexdigest()[:16]
    return {
        "architecture": architecture,
        "dtype": dtype,
        "weight_format": weight_format,
        "config": config,
        "weights": files,
    }


def fingerprint(
    model: dict[str, str],
    kv_cache: dict[str, object],
    prompt_token_ids: list[int],
    sampling: dict[str, Any],
) -> dict[str, Any]:
    """What must agree between the two halves for one choice. `sampling` is the choice's
    `Resolution.to_dict()` (effective values and their sources)."""
    prompt = hashlib.sha256(json.dumps(prompt_token_ids).encode()).hexdigest()[:16]
    return {
        "model": model,
        "kv_cache": kv_cache,
        "prompt": {"sha256": prompt, "num_tokens": len(prompt_token_ids)},
        "sampling": {"effective": sampling["effective"], "source": sampling["source"]},
    }


def disagreements(prefill: dict[str, Any], decode: dict[str, Any]) -> list[str]:
    """Each way the prefill's fingerprint differs from the decode's, as a sentence; [] if
    none. Sampling differences name the field, both values and both sources."""
    found = []
    for key, label in (("model", "model"), ("kv_cache", "KV cache"), ("prompt", "prompt tokens")):
        if prefill.get(key) != decode[key]:
            hint = " (another tokenizer or chat template?)" if key == "prompt" else ""
            found.append(f"{label}: prefill {prefill.get(key)}, decode {decode[key]}{hint}")
    theirs = prefill.get("sampling", {})
    mine = decode["sampling"]
    values, sources = theirs.get("effective", {}), theirs.get("source", {})
    for name in sorted(set(values) | set(mine["effective"])):
        if values.get(name) != mine["effective"].get(name):
            found.append(
                f"{name}: prefill {values.get(name)!r} ({sources.get(name, 'builtin')}), "
                f"decode {mine['effective'].get(name)!r} ({mine['source'].get(name, 'builtin')})"
            )
    return found


def pack_handoff(handoff: Handoff, fingerprint: dict[str, Any]) -> PackedHandoff:
    header = {
        "fingerprint": fingerprint,
        "num_tokens": handoff.rows.num_tokens,
        "first_token": handoff.first_token,
        "first_logprobs": _logprobs_json(handoff.first_logprobs),
        "prompt_logprobs": None
        if handoff.prompt_logprobs is None
        else [_logprobs_json(lp) for lp in handoff.prompt_logprobs],
    }
    tensors = dict(handoff.rows.tensors)
    if handoff.generator_state is not None:
        tensors[GENERATOR] = handoff.generator_state
    return PackedHandoff(header, tensors)


def unpack_handoff(packed: PackedHandoff) -> tuple[Handoff, dict[str, Any]]:
    """The Handoff and the prefill's fingerprint; raises ValueError for a malformed header."""
    header, tensors = packed.header, dict(packed.tensors)
    try:
        generator = tensors.pop(GENERATOR, None)
        prompt_logprobs = header["prompt_logprobs"]
        handoff = Handoff(
            rows=KVRows(int(header["num_tokens"]), tensors),
            first_token=int(header["first_token"]),
            first_logprobs=_logprobs(header["first_logprobs"]),
            generator_state=generator,
            prompt_logprobs=None
            if prompt_logprobs is None
            else [_logprobs(lp) for lp in prompt_logprobs],
        )
        return handoff, dict(header["fingerprint"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed handoff header: {exc!r}") from exc


def _logprobs_json(lp: TokenLogprobs | None) -> dict[str, Any] | None:
    return None if lp is None else dataclasses.asdict(lp)


def _logprobs(data: dict[str, Any] | None) -> TokenLogprobs | None:
    if data is None:
        return None
    top = [(int(t), float(v)) for t, v in data["top"]]
    return TokenLogprobs(int(data["token_id"]), float(data["logprob"]), int(data["rank"]), top)
