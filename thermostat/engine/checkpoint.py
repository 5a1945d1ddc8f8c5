"""A model's files as the loader reads them, whatever they are: a Hugging Face directory
(`HFCheckpoint`) or a GGUF file (thermostat.models.gguf_checkpoint). Each gives the config, the
tensors under Hugging Face names (dequantized where the checkpoint is quantized), the tokenizer,
where generation_config.json is looked up, the engine format it is served in by default and a
line saying what it holds. Every failure is a ModelLoadError naming the file or field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from thermostat.kernels import LinearOps
from thermostat.models.gguf_blocks import BlockGrid
from thermostat.models.gguf_checkpoint import GGUFCheckpoint, is_gguf
from thermostat.models.quantized_checkpoints import WeightReader, weight_reader
from thermostat.models.weights import Loaded


class ModelLoadError(ValueError):
    """The model cannot be served; the message says which file or field."""


class Checkpoint(Protocol):
    config: PretrainedConfig

    @property
    def directory(self) -> Path:
        """Where generation_config.json is looked up."""

    @property
    def config_dict(self) -> dict[str, Any]:
        """config.json, or what stands for it."""

    @property
    def serve_as(self) -> str | None:
        """int8 | int4 where the checkpoint is integer-quantized, else None (the dtype)."""

    @property
    def source(self) -> str:
        """What the checkpoint holds: 'safetensors bfloat16', 'gptq 4-bit g128', 'gguf Q8_0'."""

    def tensors(
        self, grids: bool = False, ops: LinearOps | None = None
    ) -> Iterator[tuple[str, Loaded]]:
        """(name, float tensor) one at a time; `grids`: keep the blocks of those the kernels run
        as stored, for `grid`; `ops`: the kernels, which unpack stored blocks."""

    def grid(self, name: str) -> BlockGrid | None:
        """The blocks tensor `name` (yielded by `tensors(grids=True)`) is stored in, where the
        kernels run them as stored (a GGUF file's), handed over once; else None (its values are
        quantized at load)."""

    def tokenizer(self) -> PreTrainedTokenizerBase: ...


def open_checkpoint(path: Path) -> Checkpoint:
    """A model directory or .gguf file (as `loader.resolve_model_path` gives it)."""
    if is_gguf(path):
        try:
            return GGUFCheckpoint.open(path)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
    return HFCheckpoint.open(path)


@dataclass
class HFCheckpoint:
    """A Hugging Face model directory: config.json, safetensors, tokenizer files."""

    directory: Path
    config: PretrainedConfig
    config_dict: dict[str, Any]
    reader: WeightReader | None  # the quantization_config's, None for float weights

    @classmethod
    def open(cls, path: Path) -> HFCheckpoint:
        try:
            config = AutoConfig.from_pretrained(path)
        except Exception as exc:  # transformers raises several types for a bad config
            raise ModelLoadError(f"{path / 'config.json'}: {exc}") from exc
        try:
            reader = weight_reader(config)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
        return cls(path, config, json.loads((path / "config.json").read_text()), reader)

    @property
    def serve_as(self) -> str | None:
        return None if self.reader is None else self.reader.serve_as

    @property
    def source(self) -> str:
        if self.reader is not None:
            return self.reader.source
        declared = getattr(self.config, "dtype", None) or getattr(self.config, "torch_dtype", None)
        return f"safetensors {str(declared or 'float32').removeprefix('torch.')}"

    def tensors(
        self, grids: bool = False, ops: LinearOps | None = None
    ) -> Iterator[tuple[str, Loaded]]:
        stored = iter_tensors(weight_files(self.directory))
        return stored if self.reader is None else self.reader.read(stored)

    def grid(self, name: str) -> BlockGrid | None:
        return None

    def tokenizer(self) -> PreTrainedTokenizerBase:
        path = self.directory
        if (
            not (path / "tokenizer.json").is_file()
            and not (path / "tokenizer_config.json").is_file()
        ):
            raise ModelLoadError(f"{path}: tokenizer.json / tokenizer_config.json is missing")
        tokenizer = AutoTokenizer.from_pretrained(path)
        template_file = path / "chat_template.jinja"
        if tokenizer.chat_template is None and template_file.is_file():
            tokenizer.chat_template = template_file.read_text()
        return tokenizer


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
