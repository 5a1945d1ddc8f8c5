"""GGUF files (llama.cpp's one-file checkpoints): `thermostat serve --model model.gguf`.

The config, tokenizer and chat template come from the file's metadata through transformers
(`AutoConfig` / `AutoTokenizer` with `gguf_file`, kept on disk: `gguf_reading`); a tokenizer.json
or tokenizer_config.json beside the file wins over the metadata's tokenizer, and a
generation_config.json beside it gives generation defaults (without one: the builtin ones).
Tensors are read one at a time with the `gguf` package, dequantized to float32
(`gguf.quants.dequantize`) and renamed to the Hugging Face names of transformers' model for the
config (gguf's tensor name map); llama.cpp's converter permutes the rows of Llama's q and k
projections for its rotary layout, which `read` undoes.

| GGUF type        | a block of weights                     | served as (default)              |
|------------------|----------------------------------------|----------------------------------|
| F32, F16, BF16   | as stored                              | that dtype                       |
| Q8_0, Q5_0       | 32: d q; d (q - 16), q 5-bit           | int8, the file's q and d         |
| Q4_0             | 32: d (q - 8), q 4-bit                 | int4, the file's grid            |
| Q4_1             | 32: d q + m, q 4-bit                   | int4 with its float16 minimums   |
|                  |                                        | (1)                              |
| Q4_K             | 256: 8 x 32, (d sc_j) q - dmin m_j,    | 4-bit with float32 scales and    |
|                  | q 4-bit, sc_j and m_j 6-bit            | minimums (2)                     |
| Q5_1, Q5_K, Q6_K | Q5_1 32: d q + m; Q5_K as Q4_K, q      | int8 with a float32 scale per 16 |
|                  | 5-bit; Q6_K 256: 16 x 16, (d sc_j)     | and minimum per 32 (2)           |
|                  | (q - 32), q 6-bit, sc_j int8           |                                  |
| Q3_K             | 256: 16 x 16, (d sc_j) q, q 3-bit      | int8 with a float32 scale per 16 |
|                  | (-4..3), sc_j 6-bit minus 32           | (2)                              |
| IQ4_NL           | 32: d L[q], L 16 int8 levels, q 4-bit  | int8, the levels and the file's d |
| IQ4_XS           | 256: 8 x 32, (d sc_j) L[q], sc_j 6-bit | int8 with a float32 scale per 16 |
|                  | minus 32                               | (2)                              |

Every quantized tensor is served as stored (`grid`; gguf_blocks.py packs its blocks exactly),
whatever the file's main type is; a fused projection whose parts differ (a Q4_K_M file's Q4_K
q and k with its Q6_K v) takes the record that holds both (int8 with float32 scales). The
format reported (`serve_as`) is the main type's body: int4 for Q4_0, Q4_1 and Q4_K files, int8
for the others; `--quantization` requantizes the dequantized weights instead. Stacked MoE experts
([E, ...] tensors) are served as stored expert by expert. Other types (Q2_K, whose minimums
per 16 no record holds, and the IQ1-IQ3 types) are refused at open. The compute dtype ("auto")
is the float file's, bfloat16 for a quantized one.

(1) The kernel adds m s sum(xq) per block, llama.cpp's Q4_1 x Q8_1 product (quant.py's
`bits` 5). (2) A K-quant's block scale, its float16 d times a 6-bit (Q6_K: 8-bit) scale, needs
up to 17 bits of mantissa, which float16 has not and float32 has, as it has dmin m_j (quant.py's
`bits` 6 and 9; Q6_K's and Q3_K's two sub-blocks of a block of 32 each keep their scale).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import (
    MODEL_ARCH_NAMES,
    GGUFReader,
    LlamaFileType,
    ReaderTensor,
    get_tensor_name_map,
)
from gguf.quants import dequantize
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from thermostat.kernels import LinearOps
from thermostat.models.gguf_blocks import EXACT_TYPES, BlockGrid, dequantized
from thermostat.models.gguf_reading import (
    cached_config,
    cached_names,
    cached_tokenizer,
    read_header,
    release_pages,
)
from thermostat.models.weights import Deferred, Loaded

FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# the GGML types served with a 4-bit body (the others with an int8 one: gguf_blocks' table)
INT4_BODY = ("Q4_0", "Q4_1", "Q4_K")
EXPERTS = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate|up|down)_exps\.weight")
NORMS_PLUS_ONE = ("gemma2", "gemma3")  # files whose norm weights hold 1 + w (transformers': w)
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's llama3 rope: a divisor per frequency


def served_types() -> tuple[str, ...]:
    """The GGML types served as the file stores them: the float ones and gguf_blocks' table."""
    return (*FLOAT_TYPES, *EXACT_TYPES)


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf" and path.is_file()


def unpermute_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation (convert_hf_to_gguf `LlamaModel.permute`): per head, its
    rows [first halves of pairs..., second halves...] back to Hugging Face's order."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@dataclass
class GGUFCheckpoint:
    """One .gguf file: its config and what its tensors are."""

    path: Path
    reader: GGUFReader
    config: PretrainedConfig
    architecture: str  # general.architecture: llama, qwen2, ...
    main_type: str  # the GGML type holding most weights: Q8_0, Q4_K, BF16, ...
    file_type: str  # general.file_type's name (Q4_K_M), else main_type
    metadata: dict[str, Any] = field(default_factory=dict)
    # Hugging Face name -> its stored blocks, rows in the model's order, as `tensors(grids=True)`
    # has read them: what `grid` hands over (once)
    grids: dict[str, BlockGrid] = field(default_factory=dict)

    @classmethod
    def open(cls, path: Path) -> GGUFCheckpoint:
        """ValueError naming the file and what in it cannot be served."""
        try:
            reader = read_header(path)
        except (ValueError, OSError, IndexError, KeyError) as exc:
            size = path.stat().st_size
            raise ValueError(
                f"{path}: not a readable GGUF file, truncated or not GGUF ({size} bytes; {exc})"
            ) from exc
        unserved = sorted({t.tensor_type.name for t in reader.tensors} - set(served_types()))
        if unserved:
            raise ValueError(
                f"{path}: holds tensors of GGML type {', '.join(unserved)}, which Thermostat "
                f"does not serve (it serves {', '.join(served_types())})"
            )
        metadata = {k: f.contents() for k, f in reader.fields.items() if not _is_vocab(k)}
        architecture = str(metadata.get("general.architecture", ""))
        try:
            config = cached_config(path)
        except Exception as exc:  # transformers raises several types for an unknown file
            raise ValueError(f"{path}: transformers cannot read its config ({exc})") from exc
        main_type = _main_type(reader)
        if not getattr(config, "architectures", None):
            causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
            config.architectures = [causal] if causal else []
        config.dtype = FLOAT_TYPES.get(main_type, "bfloat16")
        _fill_config(config, metadata, reader, path)
        try:
            file_type = LlamaFileType(int(metadata["general.file_type"]))
            named = file_type.name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except (KeyError, ValueError, TypeError):
            named = main_type
        return cls(path, reader, config, architecture, main_type, named, metadata)

    @property
    def serve_as(self) -> str | None:
        """int8 | int4 | None (the dtype), by the body its main type is served with (the
        docstring's table); each quantized tensor is served as stored (`grid`) whatever it is."""
        if self.main_type in FLOAT_TYPES:
            return None
        return "int4" if self.main_type in INT4_BODY else "int8"

    def grid(self, name: str) -> BlockGrid | None:
        """The blocks of the quantized tensor `tensors(grids=True)` yielded as `name` (a Hugging
        Face name; a stacked tensor's expert e as `...experts.{e}.{proj}_proj.weight`), its rows
        in the model's order, handed over once; None for a float tensor."""
        return self.grids.pop(name, None)

    @property
    def source(self) -> str:
        return f"gguf {self.file_type}"

    @property
    def directory(self) -> Path:
        """Where a tokenizer and generation_config.json beside the file are looked up."""
        return self.path.parent

    @property
    def config_dict(self) -> dict[str, Any]:
        """What stands for config.json: the config the metadata gives."""
        config: dict[str, Any] = self.config.to_dict()
        return config

    def tensors(
        self, grids: bool = False, ops: LinearOps | None = None
    ) -> Iterator[tuple[str, Loaded]]:
        """(Hugging Face name, float32 tensor), one tensor of the file at a time; a stacked
        experts tensor [E, ...] as one tensor per expert. A quantized tensor's blocks are read
        once (BlockGrid) and its floats made from them; `grids`: the blocks kept for `grid`, and
        the floats Deferred (made only for a weight the model does not serve as its blocks);
        `ops`: the kernels, which unpack the blocks. ValueError naming a tensor the model has no
        name for."""
        names = cached_names(self.path, self._hf_names)
        heads = {
            "attn_q": self.config.num_attention_heads,
            "attn_k": getattr(self.config, "num_key_value_heads", None)
            or self.config.num_attention_heads,
        }
        for tensor in self.reader.tensors:
            if tensor.name == ROPE_FREQS:
                continue  # in the config's rope parameters (`_fill_config`)
            experts = EXPERTS.fullmatch(tensor.name)
            if experts is not None:
                yield from self._experts(tensor, experts, grids, ops)
            elif tensor.name not in names:
                raise ValueError(f"{self.path}: tensor {tensor.name} has no place in the model")
            else:
                name = names[tensor.name]
                yield name, self._tensor(tensor, name, heads, grids, ops)
            release_pages(self.reader, tensor)  # read: its copy is the model's now

    def _tensor(
        self,
        tensor: ReaderTensor,
        name: str,
        heads: dict[str, int],
        grids: bool,
        ops: LinearOps | None,
    ) -> Loaded:
        """One tensor (not stacked experts) as `tensors` yields it, under Hugging Face `name`."""
        kind = tensor.name.split(".")[-2] if tensor.name.startswith("blk.") else ""
        permuted = heads[kind] if self.architecture == "llama" and kind in heads else None
        # llama.cpp's converter stored Gemma's norms as 1 + w
        plus_one = self.architecture in NORMS_PLUS_ONE and tensor.name.endswith("norm.weight")
        if tensor.tensor_type.name in EXACT_TYPES:
            grid = BlockGrid.read(tensor.data, tensor.tensor_type.name, ops)
            if permuted is not None:
                grid = grid.rows(unpermute_rows(torch.arange(len(grid.q)), permuted))
            if grids:
                self.grids[name] = grid
            if grids and not plus_one:  # its floats made only if the model keeps them
                return Deferred(grid.q.shape, grid.dequantize)
            values = grid.dequantize()
        else:
            values = torch.from_numpy(dequantized(tensor.data, tensor.tensor_type))
            if permuted is not None:
                values = unpermute_rows(values, permuted)
        return values - 1.0 if plus_one else values

    def _experts(
        self, tensor: ReaderTensor, match: re.Match[str], grids: bool, ops: LinearOps | None
    ) -> Iterator[tuple[str, Loaded]]:
        """A stacked experts tensor [E, ...] as one (name, float32 tensor) per expert; a
        quantized one's blocks read per expert (kept for `grid` with `grids`)."""
        prefix = f"model.layers.{match['layer']}.mlp.experts"
        names = [f"{prefix}.{e}.{match['proj']}_proj.weight" for e in range(len(tensor.data))]
        if tensor.tensor_type.name not in EXACT_TYPES:
            values = torch.from_numpy(dequantized(tensor.data, tensor.tensor_type))
            yield from zip(names, values, strict=True)
            return
        for name, blocks in zip(names, tensor.data, strict=True):
            grid = BlockGrid.read(blocks, tensor.tensor_type.name, ops)
            if grids:
                self.grids[name] = grid
            yield name, Deferred(grid.q.shape, grid.dequantize) if grids else grid.dequantize()

    def _hf_names(self) -> dict[str, str]:
        """GGUF tensor name -> the Hugging Face name, through gguf's name map over the names of
        transformers' model for this config (built on the meta device: no memory)."""
        arch = next((a for a, name in MODEL_ARCH_NAMES.items() if name == self.architecture), None)
        if arch is None:
            raise ValueError(f"{self.path}: gguf does not know architecture {self.architecture}")
        name_map = get_tensor_name_map(arch, self.config.num_hidden_layers)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config)  # type: ignore[no-untyped-call]
        names: dict[str, str] = {}
        for hf_name in model.state_dict():
            base, _, suffix = hf_name.rpartition(".")
            gguf_name = name_map.get_name(base)
            if gguf_name is not None:
                names.setdefault(f"{gguf_name}.{suffix}", hf_name)
        return names

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer beside the file when there is one, else the file's own."""
        beside = self.directory
        if (beside / "tokenizer.json").is_file() or (beside / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(beside)
        return cached_tokenizer(self.path)


def _is_vocab(key: str) -> bool:
    return key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[1] in (
        "tokens",
        "scores",
        "token_type",
        "merges",
    )


def _main_type(reader: GGUFReader) -> str:
    """The quantized type holding the most weights of the file's matrices, else its float
    type holding the most."""
    counts: dict[str, int] = {}
    for t in reader.tensors:
        if len(t.shape) >= 2:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    quantized = {k: v for k, v in counts.items() if k not in FLOAT_TYPES}
    pool = quantized or counts
    return max(pool, key=lambda k: pool[k]) if pool else "F32"


def _fill_config(
    config: PretrainedConfig, metadata: dict[str, Any], reader: GGUFReader, path: Path
) -> None:
    """What transformers' GGUF config leaves out: an MoE's expert width
    (`{arch}.expert_feed_forward_length`), the rope scaling `{arch}.rope.scaling.type` (linear
    or yarn) declares, and llama3's per-frequency divisors, stored as the tensor rope_freqs.weight
    (kept as rope `frequency_factors`, which llama.cpp divides by)."""
    arch = metadata.get("general.architecture")
    expert_width = metadata.get(f"{arch}.expert_feed_forward_length")
    if expert_width and hasattr(config, "moe_intermediate_size"):
        config.moe_intermediate_size = int(expert_width)
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = metadata.get(f"{arch}.rope.scaling.type")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind in ("linear", "yarn") and factor:
        params.update(rope_type=kind, factor=float(factor))
        original = metadata.get(f"{arch}.rope.scaling.original_context_length")
        if kind == "yarn" and original:
            params["original_max_position_embeddings"] = int(original)
    elif kind not in (None, "none"):
        raise ValueError(f"{path}: {arch}.rope.scaling.type={kind!r} is not supported")
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        factors = dequantize(freqs.data, freqs.tensor_type).astype(np.float32).reshape(-1)
        params["frequency_factors"] = [float(f) for f in factors]
    config.rope_parameters = params
