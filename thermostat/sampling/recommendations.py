"""Model families' published sampling recommendations, and family detection from config.json
(or the config a GGUF file's metadata gives).

Each entry names where its values come from. The `recommended` layer uses them only when the
operator opts in (`--sampling-defaults recommended`).

A family is told by what identifies it, most specific first:

| evidence                                                   | family                       |
|------------------------------------------------------------|------------------------------|
| `thermostat_family` (Thermostat's own models)              | as it says                   |
| the model's name (`_name_or_path`, a GGUF's `general.name`)| smollm2 (1)                  |
| `model_type`                                               | deepseek, qwen*, gemma3, llama |

(1) SmolLM2 is a Llama architecture (`model_type: llama`) with values of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Recommendation:
    family: str
    values: dict[str, Any]
    source: str


# fmt: off
RECOMMENDATIONS: dict[str, Recommendation] = {
    # DeepSeek-R1 model card, "Usage Recommendations": temperature 0.5-0.7, 0.6 recommended,
    # top-p 0.95.
    "deepseek": Recommendation("deepseek", {"temperature": 0.6, "top_p": 0.95},
                               "DeepSeek-R1 model card, usage recommendations"),
    # Qwen3 model card, "Best Practices", thinking mode: Temperature=0.6, TopP=0.95, TopK=20,
    # MinP=0.
    "qwen3": Recommendation("qwen3", {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0},
                            "Qwen3 model card, best practices (thinking mode)"),
    # Qwen2.5-Instruct generation_config.json as published by Qwen.
    "qwen2": Recommendation("qwen2", {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                      "repetition_penalty": 1.05},
                            "Qwen2.5-Instruct generation_config.json"),
    # Llama-3.x-Instruct generation_config.json as published by Meta.
    "llama": Recommendation("llama", {"temperature": 0.6, "top_p": 0.9},
                            "Llama-3.x-Instruct generation_config.json"),
    # Gemma 3 instruction-tuned generation_config.json as published by Google (gemma-3-1b-it):
    # top_k 64, top_p 0.95, at temperature 1.
    "gemma3": Recommendation("gemma3", {"temperature": 1.0, "top_p": 0.95, "top_k": 64},
                             "Gemma 3 instruction-tuned generation_config.json (Google)"),
    # SmolLM2-Instruct model cards (HuggingFaceTB), "How to use": generate(..., temperature=0.2,
    # top_p=0.9, do_sample=True).
    "smollm2": Recommendation("smollm2", {"temperature": 0.2, "top_p": 0.9},
                              "SmolLM2-Instruct model card (HuggingFaceTB), how to use"),
    # Thermostat's bundled demo model: measured by tools/demo_sweep.py (the lowest loop rate
    # among settings whose text stays close to the corpus; table in the model card).
    "thermostat-demo": Recommendation("thermostat-demo", {"temperature": 0.7, "top_p": 0.95},
                                      "thermostat/models/demo/README.md, sampling sweep"),
}
# fmt: on


def detect_family(config: dict[str, Any]) -> str | None:
    """The family key of RECOMMENDATIONS that a HF config.json belongs to, if any."""
    if config.get("thermostat_family") in RECOMMENDATIONS:  # set by Thermostat's own models
        family: str = config["thermostat_family"]
        return family
    names = " ".join(str(config.get(k, "")) for k in ("_name_or_path", "_model_name_or_path"))
    if "smollm" in names.lower():
        return "smollm2"
    model_type = str(config.get("model_type", "")).lower()
    if model_type.startswith("deepseek"):
        return "deepseek"
    if model_type.startswith("qwen3"):
        return "qwen3"
    if model_type.startswith("qwen2"):
        return "qwen2"
    if model_type.startswith("gemma3"):
        return "gemma3"
    if model_type == "llama":
        return "llama"
    return None


def recommendation_for(config: dict[str, Any]) -> Recommendation | None:
    family = detect_family(config)
    return RECOMMENDATIONS.get(family) if family else None
