"""Model families by the Hugging Face architecture name in config.json, and the interface the
engine runs them through.

Adding a family is one module under thermostat/models/ with a class
that satisfies `CausalLM` (its own arch dataclass, its cache components in `cache_spec`, its
layers choosing their ops as thermostat.kernels lists), plus one line per architecture name in
`ARCHITECTURES`. Nothing in engine/ names a family.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch

from thermostat.kernels import CpuOps
from thermostat.models.attention import AttentionMetadata
from thermostat.models.deepseek import DeepseekModel
from thermostat.models.deepseek_v4 import DeepseekV4Model
from thermostat.models.gemma3 import Gemma3Model
from thermostat.models.kv_cache import PagedKVCache
from thermostat.models.kv_spec import KVCacheSpec
from thermostat.models.layers import Filled
from thermostat.models.llama import LlamaFamilyModel
from thermostat.models.weights import Loaded

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class ArchFacts(Protocol):
    """What the engine reads of any family's parsed config.json."""

    @property
    def architecture(self) -> str: ...  # the config's architectures entry served
    @property
    def num_layers(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def sliding_window(self) -> int | None: ...  # tokens a query attends back, None: all
    @property
    def max_position_embeddings(self) -> int: ...


class Drafter(Protocol):
    """A model with multi-token-prediction layers (models.next_n): after the main forward, one
    more layer over the step's rows proposes each request's token after next."""

    num_next_n: int

    def draft(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        rows: torch.Tensor,
    ) -> torch.Tensor: ...


class CausalLM(Protocol):
    """A decoder over the paged KV cache. Built by the loader as
    `cls(cls.arch_from_config(config, name), config, dtype, max_positions, ops)`, then
    `load_weights`; the engine allocates the cache `cache_spec` describes and calls the model
    once per step with every scheduled token flat (see models.attention for the order)."""

    @property
    def arch(self) -> ArchFacts: ...

    def __init__(
        self,
        arch: ArchFacts,
        config: PretrainedConfig,
        dtype: torch.dtype,
        max_positions: int,
        ops: CpuOps | None = None,
    ) -> None: ...

    @classmethod
    def arch_from_config(cls, config: PretrainedConfig, architecture: str) -> ArchFacts:
        """The family's arch from a transformers PretrainedConfig; ValueError or AttributeError
        for a config it cannot serve."""
        ...

    def cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """What one cache block holds for this model, stored in `dtype`."""
        ...

    def load_weights(
        self,
        tensors: Iterable[tuple[str, Loaded]],
        filled: Filled | None = None,
    ) -> None:
        """Hugging Face parameter names and tensors; ValueError naming a missing, unexpected or
        misshapen parameter. `filled(path, sources)`: called with each module loaded whole, as
        soon as it is, with where its checkpoint tensors went (True: it replaced the module)."""
        ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]; writes the new
        tokens into `cache`."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        ...


ARCHITECTURES: dict[str, type[CausalLM]] = {
    "Gemma3ForCausalLM": Gemma3Model,
    "DeepseekV2ForCausalLM": DeepseekModel,
    "DeepseekV3ForCausalLM": DeepseekModel,
    "DeepseekV4ForCausalLM": DeepseekV4Model,
    "LlamaForCausalLM": LlamaFamilyModel,
    "MistralForCausalLM": LlamaFamilyModel,
    "MixtralForCausalLM": LlamaFamilyModel,
    "Qwen2ForCausalLM": LlamaFamilyModel,
    "Qwen3ForCausalLM": LlamaFamilyModel,
    "Qwen3MoeForCausalLM": LlamaFamilyModel,
}


def model_class(architectures: list[str]) -> tuple[str, type[CausalLM]]:
    """The first of config.json's `architectures` that Thermostat serves, and its class.
    ValueError naming the supported architectures when there is none."""
    for name in architectures:
        if name in ARCHITECTURES:
            return name, ARCHITECTURES[name]
    raise ValueError(
        f"architectures={architectures} is not supported; "
        f"Thermostat serves {', '.join(ARCHITECTURES)}"
    )
