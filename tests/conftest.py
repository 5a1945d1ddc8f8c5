"""Fixtures: tiny random-weight checkpoints (thermostat.random_model) and the transformers
reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from thermostat.random_model import CONFIGS, build_tokenizer, write_model

__all__ = ["CONFIGS", "build_tokenizer", "hf_model", "write_model"]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("llama"), "llama")


def hf_model(path: Path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()
