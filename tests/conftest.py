"""Test helpers: tiny random-weight checkpoints (thermostat.random_model) and the transformers
reference model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from thermostat import LLM, SamplingParams, kernels
from thermostat.kernels.build import AVX2, FULL, FULL_EMULATED, FULL_NO_AMX, cpu_flags
from thermostat.random_model import CONFIGS, write_model

__all__ = [
    "BUILDS",
    "CONFIGS",
    "hf_greedy",
    "hf_model",
    "prompt_logprobs",
    "write_model",
    "write_v3_with_next_n",
]

# the kernel builds (thermostat.kernels.build)
BUILDS = {
    "avx512": FULL,
    "avx512-emulated": FULL_EMULATED,
    "avx512-no-amx": FULL_NO_AMX,
    "avx2": AVX2,
}


def kernel_build(name: str) -> kernels.CpuOps:
    """The kernels of build `name`, or the test skipped where that build cannot run here, or
    where it would only repeat another (avx512-emulated where the CPU lacks AVX512-BF16, so that
    the avx512 build is emulated already; avx512-no-amx where it lacks AMX)."""
    if name == "avx512-emulated" and "avx512_bf16" not in cpu_flags():
        pytest.skip("the avx512 build emulates bf16 dot products here already")
    if name == "avx512-no-amx" and "amx_tile" not in cpu_flags():
        pytest.skip("the avx512 build runs without AMX here already")
    built = kernels.build_ops(BUILDS[name])
    if built is None:
        pytest.skip(f"the {name} build does not run here ({kernels.status()})")
    return built


# Every hypothesis test, whatever its own settings leave unsaid: an example's duration and the
# time to generate data depend on what else the machine runs, so neither is checked.
settings.register_profile("thermostat", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("thermostat")


@pytest.fixture(autouse=True, scope="session")
def gguf_cache(tmp_path_factory) -> Path:
    """The GGUF conversions (thermostat.models.gguf_reading) cached in the session's temporary
    folder, not the user's cache; servers the tests start inherit it."""
    folder = tmp_path_factory.mktemp("gguf-cache")
    os.environ["THERMOSTAT_GGUF_CACHE"] = str(folder)
    return folder


@pytest.fixture(params=list(BUILDS))
def ops(request) -> kernels.CpuOps:
    """Each kernel build this CPU runs (an AVX-512 machine runs the AVX2 build too), for tests
    that hold the kernels to their references; skipped where the build cannot run."""
    return kernel_build(request.param)


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


def prompt_logprobs(llm: LLM, prompts: list[list[int]], vocab: int) -> list[torch.Tensor]:
    """Per prompt, the engine's next-token log-probabilities at every position but the last
    [len - 1, vocab]."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=vocab)
    rows = []
    for out in llm.generate(prompts, params):
        got = torch.full((len(out.prompt_logprobs) - 1, vocab), float("nan"))
        for pos, lp in enumerate(out.prompt_logprobs[1:]):
            for token, value in lp.top:
                got[pos, token] = value
        rows.append(got)
    return rows


def write_v3_with_next_n(path: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A random DeepSeek-V3 checkpoint with one multi-token-prediction layer, which transformers
    neither builds nor saves: layer L shaped like the last one (MoE, weights of its own), its
    norms, eh_proj, an untied head and the checkpoint's copy of the embeddings."""
    path = write_model(path, "deepseek_v3", dtype=dtype)
    config = json.loads((path / "config.json").read_text())
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    weights = load_file(path / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    gen = torch.Generator().manual_seed(7)
    last, prefix = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    for name, tensor in list(weights.items()):
        if name.startswith(last):
            noise = torch.randn(tensor.shape, generator=gen) * tensor.float().std()
            weights[prefix + name.removeprefix(last)] = tensor if tensor.dim() < 2 else noise
    weights |= {
        prefix + "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
        prefix + "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
        prefix + "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=gen),
        prefix + "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
        prefix + "shared_head.head.weight": 0.2 * torch.randn(embed.shape, generator=gen),
        prefix + "embed_tokens.weight": embed,
    }
    weights = {k: v.to(embed.dtype).clone() for k, v in weights.items()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return path
