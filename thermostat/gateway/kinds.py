"""Upstream kinds: how each names the sampling fields, and which it cannot take.

| kind       | top_k           | min_p | repetition_penalty | refused when sent      | n + seed |
|------------|-----------------|-------|--------------------|------------------------|----------|
| thermostat | top_k           | min_p | repetition_penalty | -                      | seed + j |
| vllm       | top_k           | min_p | repetition_penalty | -                      | seed + j |
| sglang     | top_k           | min_p | repetition_penalty | -                      | unknown  |
| llamacpp   | top_k (off = 0) | min_p | repeat_penalty     | NOT_OPENAI             | unknown  |
| openai     | -               | -     | -                  | NOT_OPENAI, ignore_eos | unknown  |

vLLM and SGLang take top_k, min_p and repetition_penalty as extra body fields; llama-server
reads `repeat_penalty` and turns top-k off with 0 (tools/server/README.md of llama.cpp). A
layered field a kind lacks is refused (400) when the client sent a non-neutral value, and
otherwise dropped and reported in `sampling.adjusted` (policy `upstream_unsupported`).
NOT_OPENAI: min_tokens, stop_token_ids, skip_special_tokens. DRY and XTC (`dry_*`, `xtc_*`):
Thermostat's and llama-server's, under the same names; the others lack them.

n + seed: what seed sample j of an `n > 1` seeded request runs on. Thermostat runs it on
seed + j (sampling/fanout.py) and so does vLLM (v1 `ParentRequest._get_child_sampling_params`):
the gateway reports each choice's seed. Elsewhere it is not documented: a later sample's seed
is reported unknown (null, source `upstream`) rather than guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from thermostat.sampling.fields import BUILTIN


@dataclass(frozen=True)
class UpstreamKind:
    name: str
    renames: dict[str, str] = field(default_factory=dict)  # our field name -> the upstream's
    unsupported: frozenset[str] = frozenset()
    top_k_off: int = -1  # the value that turns top-k off upstream
    seeds_samples: bool = False  # sample j of an n > 1 seeded request runs on seed + j

    def supports(self, name: str) -> bool:
        return name not in self.unsupported

    def wire(self, name: str, value: Any) -> tuple[str, Any]:
        """The upstream's name and value of one of our fields."""
        if name == "top_k" and value == -1:
            value = self.top_k_off
        return self.renames.get(name, name), value

    @staticmethod
    def neutral(name: str, value: Any) -> bool:
        """The value changes nothing (top_k -1, min_p 0, repetition_penalty 1)."""
        return name in BUILTIN and value == BUILTIN[name]


NOT_OPENAI = frozenset({"min_tokens", "stop_token_ids", "skip_special_tokens"})
# llama.cpp's samplers against loops: llama-server reads them under these names; vLLM, SGLang
# and OpenAI have none of them
DRY_XTC = frozenset(
    {
        "dry_multiplier",
        "dry_base",
        "dry_allowed_length",
        "dry_penalty_last_n",
        "dry_sequence_breakers",
        "xtc_probability",
        "xtc_threshold",
    }
)

KINDS: dict[str, UpstreamKind] = {
    "thermostat": UpstreamKind("thermostat", seeds_samples=True),
    "vllm": UpstreamKind("vllm", unsupported=DRY_XTC, seeds_samples=True),
    "sglang": UpstreamKind("sglang", unsupported=DRY_XTC),
    "llamacpp": UpstreamKind(
        "llamacpp",
        renames={"repetition_penalty": "repeat_penalty"},
        unsupported=NOT_OPENAI,
        top_k_off=0,
    ),
    "openai": UpstreamKind(
        "openai",
        unsupported=NOT_OPENAI | DRY_XTC | {"top_k", "min_p", "repetition_penalty", "ignore_eos"},
    ),
}
