"""Load a model: a Hugging Face directory (config, safetensors weights, tokenizer, chat template,
generation_config.json) or a GGUF file (thermostat.models.gguf_checkpoint). Every failure names
the file or field at fault.

| checkpoint                                   | read by                      | served (default) |
|----------------------------------------------|------------------------------|------------------|
| safetensors, float                           | engine.checkpoint            | the dtype        |
| safetensors, quant_method fp8                | models.fp8_weights           | the dtype        |
| safetensors, gptq / awq / compressed-tensors | models.quantized_checkpoints | int4 / int8      |
| .gguf                                        | models.gguf_checkpoint       | int4, int8, dtype |

`quantization` (int8 | int4) overrides the default; without the CPU kernels an integer checkpoint
is served dequantized in the dtype. `LoadedModel.weight_format` is what is served,
`weight_source` what the checkpoint held."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import json
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from thermostat import kernels
from thermostat.engine.checkpoint import ModelLoadError, open_checkpoint
from thermostat.engine.config import EngineConfig
from thermostat.engine.packaged_models import PACKAGED, packaged_model_path
from thermostat.models.gguf_checkpoint import is_gguf
from thermostat.models.registry import ArchFacts, CausalLM, model_class
from thermostat.models.weight_format import (
    LinearsAsLoaded,
    StoredWeights,
    check_quantization,
    hold_float32,
    quantize_model,
    quantized_weights,
    weight_bytes,
)
from thermostat.models.weights import Loaded
from thermostat.sampling.generation_config import (
    GenerationConfigDefaults,
    read_generation_config,
)

log = logging.getLogger("thermostat.loader")


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "demo"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    weight_source: str = ""  # what the checkpoint holds: safetensors bfloat16, gguf Q8_0, ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = list(self.generation_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(dict.fromkeys(ids))


def resolve_model_path(model: str | Path) -> Path:
    """'demo' names the bundled model, a PACKAGED name an installed real model's file; a .gguf
    file, or a directory holding exactly one .gguf and no safetensors, is a GGUF checkpoint
    (its file is returned); anything else a Hugging Face model directory."""
    if str(model) in PACKAGED:
        return packaged_model_path(str(model))
    path = DEMO_MODEL_DIR if str(model) == "demo" else Path(model).expanduser()
    if is_gguf(path):
        return path
    if path.is_file():
        raise ModelLoadError(f"{path}: neither a model directory nor a .gguf file")
    if not path.is_dir():
        raise ModelLoadError(f"model directory not found: {path}")
    ggufs = sorted(path.glob("*.gguf"))
    if ggufs and not any(path.glob("*.safetensors")):
        if len(ggufs) > 1:
            names = ", ".join(g.name for g in ggufs)
            raise ModelLoadError(f"{path} holds {len(ggufs)} .gguf files ({names}): name one")
        return ggufs[0]
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: config.json is missing (not a Hugging Face model directory)")
    return path


def model_config_dict(path: Path) -> dict[str, Any]:
    """config.json of a model directory, or the config a GGUF file's metadata gives (a path
    `resolve_model_path` returned): what the sampling defaults read before the model loads."""
    if is_gguf(path):
        return open_checkpoint(path).config_dict
    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    return config


def check_architecture(path: Path, config: dict[str, Any]) -> None:
    """ModelLoadError naming the model and what the engine serves when none of its config's
    `architectures` is served."""
    try:
        model_class(list(config.get("architectures") or []))
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


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


def load_configured(config: EngineConfig) -> LoadedModel:
    """`load_model` with an EngineConfig's settings."""
    return load_model(
        config.model,
        config.dtype,
        config.max_model_len,
        config.cpu_kernels,
        config.quantization,
        next_n=config.speculative == "mtp",
    )


@contextlib.contextmanager
def progress_note(what: str) -> Iterator[None]:
    """Logs `what` and, once done, how long it took (a long step of the load shows up)."""
    log.info("%s ...", what)
    start = time.perf_counter()
    yield
    log.info("%s: done in %.1f s", what, time.perf_counter() - start)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing).
    A load frees as much as it keeps (each tensor's float copy, its quantization's temporaries)
    between what it keeps; without this the freed holes stay in the process's memory."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def trimmed(tensors: Iterator[tuple[str, Loaded]], every: int = 16) -> Iterator[tuple[str, Loaded]]:
    """`tensors`, with `release_freed_memory` every `every` of them (SmolLM2's Q4_1 file: peak
    RSS during the load 1.43 GB -> 1.07 GB with the quantization as loaded)."""
    for i, item in enumerate(tensors, 1):
        yield item
        if i % every == 0:
            release_freed_memory()


@contextlib.contextmanager
def skipped_init() -> Iterator[None]:
    """torch.nn.init's in-place initializers as no-ops, in torch.nn.init and in the torch.nn
    modules that imported them, while a model whose every parameter is then loaded is built
    (what transformers' `no_init_weights` does for torch, without importing its
    modeling_utils: 1.4 s)."""
    init = torch.nn.init
    functions = {n: f for n, f in vars(init).items() if n.endswith("_") and not n.startswith("_")}
    owners = [init, *(m for n, m in list(sys.modules.items()) if n.startswith("torch.nn.modules."))]
    saved = [
        (owner, name, function)
        for owner in owners
        for name, function in functions.items()
        if getattr(owner, name, None) is function
    ]
    try:
        for module, name, _ in saved:
            setattr(module, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def load_model(
    model: str | Path,
    dtype: str = "auto",
    max_model_len: int | None = None,
    cpu_kernels: bool = True,
    quantization: str | None = None,
    next_n: bool = False,
) -> LoadedModel:
    """`cpu_kernels`: use thermostat.kernels where this machine can run them (else, or when
    False, the pure-PyTorch path). `quantization`: int8 | int4 serves the weights in that
    format (thermostat.models.weight_format), quantized once here; None: in the dtype.
    `next_n`: build and load the checkpoint's multi-token-prediction layers (a proposer for
    `--speculative mtp`); without it they are skipped."""
    path = resolve_model_path(model)
    try:
        check_quantization(quantization)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    checkpoint = open_checkpoint(path)
    config = checkpoint.config
    if not next_n and getattr(config, "num_nextn_predict_layers", None):
        config = copy.copy(config)  # the layers stay in the checkpoint, unread
        config.num_nextn_predict_layers = 0
    try:
        name, model_cls = model_class(list(getattr(config, "architectures", None) or []))
        arch = model_cls.arch_from_config(config, name)
    except (ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    torch_dtype = resolve_dtype(dtype, config)
    limit = min(max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
    ops = kernels.ops() if cpu_kernels else None
    fmt = quantization or (checkpoint.serve_as if ops is not None else None)
    if checkpoint.serve_as and fmt is None:
        log.warning(
            "%s holds %s weights, served dequantized in %s: int8 / int4 need the CPU kernels",
            path,
            checkpoint.source,
            str(torch_dtype).removeprefix("torch."),
        )
    with skipped_init():  # every parameter is loaded below (a missing one is an error)
        net = model_cls(arch, config, torch_dtype, max_positions=limit, ops=ops)
    if fmt is not None and checkpoint.serve_as is not None:
        hold_float32(cast(nn.Module, net))  # the checkpoint's grid, exactly, until quantized
    # the weights a checkpoint stores as the kernels run them (a GGUF file's blocks) served as
    # stored, unless a format was asked for
    stored = StoredWeights(checkpoint.grid, ops) if quantization is None else None
    stream: LinearsAsLoaded | None = None
    if fmt and ops:
        stream = LinearsAsLoaded(cast(nn.Module, net), fmt, ops, stored, torch_dtype)
    try:
        net.load_weights(trimmed(checkpoint.tensors(stored is not None, ops)), stream)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    if fmt is not None:
        as_stored = stored is not None and stored.served > 0
        what = (
            f"packing the rest of the weights ({fmt})"
            if as_stored
            else f"quantizing the weights to {fmt}"
        )
        try:
            with progress_note(what):
                quantize_model(cast(nn.Module, net), fmt, ops, torch_dtype, stored)
                release_freed_memory()
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
        if stored is not None and as_stored:
            total = quantized_weights(cast(nn.Module, net))
            rest = total - stored.served
            log.info(
                "weights: %d of %d as the file stores them%s", stored.served, total,
                f", {rest} quantized to {fmt}" if rest else "",
            )  # fmt: skip
    try:
        tokenizer = checkpoint.tokenizer()
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({exc})") from exc
    try:
        generation_config = read_generation_config(checkpoint.directory)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    return LoadedModel(
        path=path,
        config=config,
        config_dict=checkpoint.config_dict,
        arch=arch,
        model=net,
        tokenizer=tokenizer,
        generation_config=generation_config,
        dtype=torch_dtype,
        max_model_len=limit,
        ops=ops,
        weight_format=fmt or str(torch_dtype).removeprefix("torch."),
        weight_bytes=weight_bytes(cast(nn.Module, net)),
        weight_source=checkpoint.source,
    )
