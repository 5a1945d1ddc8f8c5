"""Load a Hugging Face model directory: config, safetensors weights, tokenizer, chat template,
generation_config.json. Every failure names the file or field at fault. Block-fp8 weights
(`quantization_config` quant_method fp8) are dequantized to the serving dtype as they are read
(thermostat.models.fp8_weights)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from thermostat import kernels
from thermostat.engine.config import EngineConfig
from thermostat.models.fp8_weights import BlockFP8
from thermostat.models.registry import ArchFacts, CausalLM, model_class
from thermostat.models.weight_format import check_quantization, quantize_model, weight_bytes
from thermostat.sampling.generation_config import (
    GenerationConfigDefaults,
    read_generation_config,
)

log = logging.getLogger("thermostat.loader")

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "demo"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """The model directory cannot be served; the message says which file or field."""


@dataclass
class LoadedModel:
    path: Path
    config: PretrainedConfig
    config_dict: dict[str, Any]
    arch: ArchFacts
    model: CausalLM
    tokenizer: PreTrainedTokenizerBase
    generation_config: GenerationConfigDefaults
    dtype: torch.dtype
    max_model_len: int
    ops: kernels.CpuOps | None = None  # the compiled kernels the model (and its KV cache) may use
    weight_format: str = ""  # int8 | int4 | the dtype's name (bfloat16, ...): as served
    weight_bytes: int = 0  # what the weights take in memory as served

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = list(self.generation_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(dict.fromkeys(ids))


def resolve_model_path(model: str | Path) -> Path:
    """'demo' names the bundled model; anything else is a directory."""
    path = DEMO_MODEL_DIR if str(model) == "demo" else Path(model).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"model directory not found: {path}")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: config.json is missing (not a Hugging Face model directory)")
    return path


def resolve_dtype(name: str, config: PretrainedConfig) -> torch.dtype:
    if name == "auto":
        declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        declared = str(declared).removeprefix("torch.") if declared else "float32"
        if declared not in DTYPES:
            raise ModelLoadError(f"config.json: unsupported dtype {declared!r}")
        return DTYPES[declared]
    if name not in DTYPES:
        raise ModelLoadError(f"dtype must be auto or one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index}: no readable weight_map ({exc})") from exc
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index} names {f.name}, which is missing")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise ModelLoadError(f"{path}: no *.safetensors weights (model.safetensors is missing)")
    return found


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, handle.get_tensor(name)


def load_configured(config: EngineConfig) -> LoadedModel:
    """`load_model` with an EngineConfig's settings."""
    return load_model(
        config.model, config.dtype, config.max_model_len, config.cpu_kernels, config.quantization
    )


@contextlib.contextmanager
def progress_note(what: str) -> Iterator[None]:
    """Logs `what` and, once done, how long it took (a long step of the load shows up)."""
    log.info("%s ...", what)
    start = time.perf_counter()
    yield
    log.info("%s: done in %.1f s", what, time.perf_counter() - start)


def load_model(
    model: str | Path,
    dtype: str = "auto",
    max_model_len: int | None = None,
    cpu_kernels: bool = True,
    quantization: str | None = None,
) -> LoadedModel:
    """`cpu_kernels`: use thermostat.kernels where this machine can run them (else, or when
    False, the pure-PyTorch path). `quantization`: int8 | int4 serves the weights in that
    format (thermostat.models.weight_format), quantized once here; None: in the dtype."""
    path = resolve_model_path(model)
    try:
        check_quantization(quantization)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers raises several types for a bad config
        raise ModelLoadError(f"{path / 'config.json'}: {exc}") from exc
    try:
        name, model_cls = model_class(list(getattr(config, "architectures", None) or []))
        arch = model_cls.arch_from_config(config, name)
        fp8 = BlockFP8.from_config(config)
    except (ValueError, AttributeError) as exc:
        raise ModelLoadError(str(exc)) from exc
    torch_dtype = resolve_dtype(dtype, config)
    limit = min(max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
    ops = kernels.ops() if cpu_kernels else None
    net = model_cls(arch, config, torch_dtype, max_positions=limit, ops=ops)
    try:
        tensors = iter_tensors(weight_files(path))
        net.load_weights(tensors if fp8 is None else fp8.read(tensors))
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    if quantization is not None:
        try:
            with progress_note(f"quantizing the weights to {quantization}"):
                quantize_model(cast(nn.Module, net), quantization, ops)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ModelLoadError(f"{path}: tokenizer.json / tokenizer_config.json is missing")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({exc})") from exc
    template_file = path / "chat_template.jinja"
    if tokenizer.chat_template is None and template_file.is_file():
        tokenizer.chat_template = template_file.read_text()
    try:
        generation_config = read_generation_config(path)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    return LoadedModel(
        path=path,
        config=config,
        config_dict=json.loads((path / "config.json").read_text()),
        arch=arch,
        model=net,
        tokenizer=tokenizer,
        generation_config=generation_config,
        dtype=torch_dtype,
        max_model_len=limit,
        ops=ops,
        weight_format=quantization or str(torch_dtype).removeprefix("torch."),
        weight_bytes=weight_bytes(cast(nn.Module, net)),
    )
