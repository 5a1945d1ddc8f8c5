"""Test helpers: tiny random-weight checkpoints (thermostat.random_model) and the transformers
reference model."""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from transformers import AutoModelForCausalLM

from thermostat.random_model import CONFIGS, write_model

__all__ = ["CONFIGS", "hf_greedy", "hf_model", "write_model"]

# Every hypothesis test, whatever its own settings leave unsaid: an example's duration and the
# time to generate data depend on what else the machine runs, so neither is checked.
settings.register_profile("thermostat", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("thermostat")


def hf_model(path: Path):
    """The transformers model of a checkpoint directory, float32, eval mode."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def hf_greedy(hf, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt`: exactly `num_tokens` new tokens (EOS is
    suppressed until then, as Thermostat's min_tokens does)."""
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        pad_token_id=hf.config.pad_token_id if hf.config.pad_token_id is not None else 0,
    )
    return out[0, len(prompt) :].tolist()
