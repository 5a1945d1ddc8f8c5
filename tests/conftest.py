"""Test helpers: tiny random-weight checkpoints (thermostat.random_model) and the transformers
reference model."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from thermostat.random_model import CONFIGS, write_model

__all__ = ["CONFIGS", "hf_model", "write_model"]


def hf_model(path: Path):
    """The transformers model of a checkpoint directory, float32, eval mode."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()
