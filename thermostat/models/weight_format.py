"""The format a model's weights are served in, and turning a loaded model into it.

| format       | linear layers, MoE experts   | embeddings and LM head | needs           |
|--------------|------------------------------|------------------------|-----------------|
| (the dtype)  | bf16 / fp16 / fp32           | the dtype              |                 |
| int8         | int8, blocks of 32 (q8_0)    | int8                   | the CPU kernels |
| int4         | 4-bit, blocks of 32          | int8                   | the CPU kernels |

The LM head stays int8 under int4, as measured on the demo model (benchmarks/quant_accuracy.py,
400 positions): a 4-bit head doubled the mean KL to bf16 (0.0082 vs 0.0044 nats), lowered top-1
agreement (0.877 vs 0.887) and kept 1 of 16 greedy continuations equal instead of 6, for 17%
fewer weight bytes.

Norms, rotary tables, biases, MoE routers and other float32 parts stay as they are.
`quantize_model` runs once after the float weights are loaded (`load_model(quantization=...)`);
`weight_bytes` is what the startup report and /server_info give. A checkpoint that is already
integer-quantized (GPTQ, AWQ, compressed-tensors, GGUF) is loaded with `hold_float32` first: its
dequantized weights then reach the quantizer on their exact grid (bfloat16 would round them
off it). A GGUF file's blocks are not quantized at all: `StoredWeights` packs each linear layer,
the embeddings and the LM head from the file's own blocks (gguf_blocks.py), whatever `fmt` is.
Each linear layer is quantized as soon as its weights are loaded (`LinearsAsLoaded`), so the
float32 copies are never all held at once; `quantize_model` does the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from thermostat.kernels import LinearOps
from thermostat.models.gguf_blocks import BlockGrid
from thermostat.models.layers import Float32Module
from thermostat.models.linear import (
    PackedEmbedding,
    PackedLinear,
    QuantEmbedding,
    QuantLinear,
    quantize_linears,
    quantized_linear,
)
from thermostat.models.moe import Experts
from thermostat.models.quant import FORMATS, QuantizedWeight, quantize
from thermostat.models.weights import Index, Sources, empty_parameters

GridOf = Callable[[str], BlockGrid | None]  # a checkpoint's name -> its stored blocks, if any


class StoredWeights:
    """The weights a checkpoint stores in a form the kernels run as stored (a GGUF file's blocks:
    `grid_of`), found from the checkpoint tensors a module's weight was loaded from (`Sources`,
    recorded as each module completes)."""

    def __init__(self, grid_of: GridOf, ops: LinearOps | None = None) -> None:
        self.grid_of, self.ops = grid_of, ops  # ops: the kernels, which pack the records
        self.sources: Sources = {}
        self.served = 0  # weights packed as stored so far

    def weight(self, param: str) -> QuantizedWeight | None:
        """Parameter `param` [N, K] as stored, its parts (a fused projection's rows) in row
        order; None unless every part is a stored grid."""
        return self._packed(self.sources.get(param, []))

    def experts(self, path: str, count: int) -> tuple[list[QuantizedWeight], ...] | None:
        """Stacked experts module `path`'s gate_up_proj and down_proj [E, N, K] as stored, one
        weight per expert each (parts: Index (e, rows)); None unless every part is a stored grid."""
        gate_up = self._per_expert(f"{path}.gate_up_proj", count)
        down = self._per_expert(f"{path}.down_proj", count)
        return None if gate_up is None or down is None else (gate_up, down)

    def _per_expert(self, param: str, count: int) -> list[QuantizedWeight] | None:
        parts = self.sources.get(param, [])
        if not parts or any(not index or not isinstance(index[0], int) for index, _ in parts):
            return None
        weights = [
            self._packed([(index[1:], name) for index, name in parts if index[0] == e])
            for e in range(count)
        ]
        return None if any(w is None for w in weights) else [w for w in weights if w]

    def _packed(self, parts: list[tuple[Index, str]]) -> QuantizedWeight | None:
        if not parts or any(len(index) > 1 for index, _ in parts):  # experts: one of [E, ...]
            return None
        grids = [self.grid_of(name) for _, name in sorted(parts, key=_first_row)]
        if any(g is None for g in grids):
            return None
        self.served += 1
        return BlockGrid.joined([g for g in grids if g is not None], self.ops)


def _first_row(part: tuple[tuple[int | slice, ...], str]) -> int:
    index = part[0]
    return index[0].start or 0 if index and isinstance(index[0], slice) else 0


def check_quantization(name: str | None) -> None:
    if name is not None and name not in FORMATS:
        raise ValueError(f"quantization must be one of {', '.join(FORMATS)}, got {name!r}")


def hold_float32(model: nn.Module) -> None:
    """The weights `quantize_model` quantizes (linear layers, MoE experts, embeddings, LM head) in
    float32 until it does. Call after building the model, before loading its weights: each is
    a new, untouched float32 tensor (`weights.empty_parameters`)."""
    held = (nn.Linear, nn.Embedding, Experts)
    empty_parameters(model, lambda m: torch.float32 if isinstance(m, held) else None)


class LinearsAsLoaded:
    """`load_weights`' `filled` callback that quantizes each linear layer as soon as its weights
    are loaded, so that a quantized model never holds all its float weights at once (float32
    for a pre-quantized checkpoint: 4 bytes per weight); MoE experts, the embeddings and the LM
    head too where the checkpoint stores them as the kernels run them (`stored`; `dtype`: what
    the embeddings give the layers, as `quantize_model`'s). Left for `quantize_model`: the LM
    head and embeddings otherwise (int8 whatever `fmt` is), other MoE experts, float32 modules
    and the modules of a layer that rewrites its weights once all are loaded (`finish_loading`:
    DeepSeek's MLA)."""

    def __init__(
        self,
        model: nn.Module,
        fmt: str,
        ops: LinearOps,
        stored: StoredWeights | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.model, self.fmt, self.ops, self.stored, self.dtype = model, fmt, ops, stored, dtype
        self.skip = {"lm_head"}
        for path, module in model.named_modules():
            if isinstance(module, Float32Module) or hasattr(module, "finish_loading"):
                self.skip |= {f"{path}.{p}" if p else path for p, _ in module.named_modules()}

    def __call__(self, path: str, sources: Sources) -> bool:
        if self.stored is not None:
            self.stored.sources.update(sources)  # for `quantize_model` too
            if path in TABLES and self._table_as_stored(path):
                return True  # never made into floats (a 128k vocabulary's: 2 GB of float32)
        if path in self.skip:
            return False
        module = self.model.get_submodule(path)
        if isinstance(module, Experts) and self.stored is not None:
            as_stored = self.stored.experts(path, module.num_experts)
            if as_stored is not None:  # packed now: their blocks and float copies let go
                module.quantize(self.fmt, self.ops, as_stored)
            return as_stored is not None
        if not isinstance(module, nn.Linear):
            return False
        parent, _, name = path.rpartition(".")
        exact = self.stored.weight(f"{path}.weight") if self.stored is not None else None
        if exact is None:
            linear = quantized_linear(module, self.fmt, self.ops)
        else:
            bias = None if module.bias is None else module.bias.detach().clone()
            linear = QuantLinear(exact, bias, self.ops)
            if self.stored is not None:
                self.stored.sources.pop(f"{path}.weight", None)
        setattr(self.model.get_submodule(parent), name, linear)
        return True

    def _table_as_stored(self, path: str) -> bool:
        """The embeddings (and a tied LM head) or the LM head served from the checkpoint's
        blocks, as `quantize_model` would serve them, if it stores them so."""
        assert self.stored is not None
        module = getattr(self.model, path, None)
        if not isinstance(module, (nn.Embedding, nn.Linear)):
            return False
        exact = self.stored.weight(f"{path}.weight")
        if exact is None:
            return False
        serve_table(self.model, path, exact, self.dtype or module.weight.dtype, self.ops)
        return True


TABLES = ("embed_tokens", "lm_head")  # `quantize_model`'s: int8, or as the checkpoint stores them


def serve_table(
    model: nn.Module, path: str, table: QuantizedWeight, dtype: torch.dtype, ops: LinearOps
) -> None:
    """`table` as `model`'s LM head (`path` lm_head), or as its embeddings, which give the
    layers `dtype` (and the LM head too where the model ties them)."""
    if path == "lm_head":
        model.lm_head = QuantLinear(table, None, ops)
        return
    model.embed_tokens = QuantEmbedding(table, dtype, ops)
    if getattr(getattr(model, "arch", None), "tie_word_embeddings", False):
        model.lm_head = QuantLinear(table, None, ops)


def quantize_model(
    model: nn.Module,
    fmt: str,
    ops: LinearOps | None,
    dtype: torch.dtype | None = None,
    stored: StoredWeights | None = None,
) -> None:
    """Every linear layer and MoE expert of `model` in `fmt`, the embeddings and LM head in
    int8 (one copy when tied), or each as the checkpoint stores it where `stored` has it;
    `dtype`: what the embeddings give the layers (default: the embedding weight's dtype).
    ValueError without the CPU kernels (nothing else computes it)."""
    check_quantization(fmt)
    if ops is None:
        raise ValueError(
            f"quantization {fmt} needs Thermostat's CPU kernels (AVX2 or AVX-512), which are off"
        )
    embed = getattr(model, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    arch = getattr(model, "arch", None)
    tied = embed is not None and bool(getattr(arch, "tie_word_embeddings", False))
    if isinstance(embed, (nn.Embedding, PackedEmbedding)):
        rows = embed.weight.detach() if isinstance(embed, nn.Embedding) else embed.table()
        exact = stored.weight("embed_tokens.weight") if stored is not None else None
        table = quantize(rows, "int8", ops) if exact is None else exact
        serve_table(model, "embed_tokens", table, dtype or rows.dtype, ops)
    if head is not None and not tied and not isinstance(head, QuantLinear):
        exact = stored.weight("lm_head.weight") if stored is not None else None
        model.lm_head = (
            quantized_linear(head, "int8", ops) if exact is None else QuantLinear(exact, None, ops)
        )
    for path, module in model.named_modules():
        if isinstance(module, Experts):
            as_stored = stored.experts(path, module.num_experts) if stored is not None else None
            module.quantize(fmt, ops, as_stored)
    quantize_linears(model, fmt, ops, skip=(Float32Module, QuantLinear))


def quantized_weights(model: nn.Module) -> int:
    """How many integer weights `model` serves (a tied embedding and LM head's one table once)."""
    kinds = (QuantLinear, QuantEmbedding)
    return len({id(m.weight) for m in model.modules() if isinstance(m, kinds)})


def weight_bytes(model: nn.Module) -> int:
    """Bytes the weights take as served: parameters, packed layers, quantized ones (each tensor
    once, however many modules share it)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        tensors: list[torch.Tensor] = list(module.parameters(recurse=False))
        if isinstance(module, PackedLinear):
            tensors.append(module.packed)
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            w = module.weight
            tensors.append(w.packed)
        if isinstance(module, (PackedLinear, QuantLinear)) and module.bias is not None:
            tensors.append(module.bias)
        for t in tensors:  # by identity: oneDNN's packed tensors have no data pointer
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())
