"""Checkpoint tensors into a model's parameters: whole, or into a slice of a fused parameter
(q/k/v rows of one projection, gate/up rows, one expert of a stacked [E, ...] tensor).

A parameter counts as loaded when the elements copied into it add up to its size; a checkpoint
never stores one element twice, so that is the completeness check for fused parameters too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

Index = tuple[int | slice, ...]  # where a checkpoint tensor goes in its parameter; () = all
# a module's parameters -> where each checkpoint tensor went in it: (index, checkpoint name)
Sources = dict[str, list[tuple[Index, str]]]


def fused_target(name: str, q_rows: int, kv_rows: int, intermediate: int) -> tuple[str, Index]:
    """A checkpoint name -> (parameter name, rows): q/k/v fused into `qkv_proj` (q's rows, then
    k's, then v's), gate/up as `gate_up_target` fuses them; any other name is its own parameter."""
    q, kv = q_rows, kv_rows
    qkv = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
    return _fused(name, "qkv_proj", qkv) or gate_up_target(name, intermediate)


def gate_up_target(name: str, rows: int) -> tuple[str, Index]:
    """A checkpoint name -> (parameter name, rows): gate/up (`rows` each) fused into
    `gate_up_proj`, gate's first; any other name is its own parameter."""
    halves = {"gate_proj": slice(0, rows), "up_proj": slice(rows, 2 * rows)}
    return _fused(name, "gate_up_proj", halves) or (name, ())


def _fused(name: str, fused: str, parts: dict[str, slice]) -> tuple[str, Index] | None:
    """`name` under `fused` at its part's rows, if it names one of `parts` (projection -> rows)."""
    for src, rows in parts.items():
        if f".{src}." in name:
            return name.replace(f".{src}.", f".{fused}."), (rows,)
    return None


@dataclass(frozen=True)
class Deferred:
    """A checkpoint tensor made only if a parameter keeps it: its shape, and how to make it (a
    GGUF block grid's floats, which a weight served as its blocks never needs)."""

    shape: torch.Size
    make: Callable[[], torch.Tensor]

    def numel(self) -> int:
        return math.prod(self.shape)


Loaded = torch.Tensor | Deferred  # what a checkpoint hands the model for one of its tensors


class ParameterFiller:
    """Copies into `module`'s parameters by name; ValueError naming an unexpected or misshapen
    tensor, and (`check_complete`) any parameter left short. A `Deferred` tensor counts as
    loaded at once and is made and copied by `materialize`, unless its module is released
    first (replaced: the weight is served from what the Deferred was made from)."""

    def __init__(self, module: nn.Module) -> None:
        self.params = dict(module.named_parameters())
        self.sizes = {n: p.numel() for n, p in self.params.items()}
        self.filled = dict.fromkeys(self.params, 0)
        self.sources: Sources = {}
        self.pending: dict[str, list[tuple[Index, Deferred]]] = {}

    def copy(self, name: str, tensor: Loaded, index: Index = (), hf_name: str = "") -> None:
        """`tensor` into parameter `name` at `index` (a Deferred one when `materialize`d);
        `hf_name` (the checkpoint's name) for messages."""
        hf_name = hf_name or name
        if name not in self.params:
            raise ValueError(f"checkpoint: unexpected parameter {hf_name}")
        target = self.params[name].detach()
        target = target[index] if index else target
        if target.shape != tensor.shape:
            raise ValueError(
                f"checkpoint: {hf_name} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        if isinstance(tensor, Deferred):
            self.pending.setdefault(name, []).append((index, tensor))
        else:
            target.copy_(tensor)
        self.filled[name] += tensor.numel()
        self.sources.setdefault(name, []).append((index, hf_name))

    def materialize(self, owner: str | None = None) -> None:
        """Make and copy the Deferred tensors of module `owner`'s own parameters (None: all)."""
        names = [n for n in self.pending if owner is None or n.rpartition(".")[0] == owner]
        for name in names:
            for index, deferred in self.pending.pop(name):
                target = self.params[name].detach()
                (target[index] if index else target).copy_(deferred.make())

    def sources_of(self, owner: str) -> Sources:
        """Module `owner`'s own parameters' checkpoint tensors (`Sources`), by parameter name."""
        return {n: s for n, s in self.sources.items() if n.rpartition(".")[0] == owner}

    def owner_complete(self, owner: str) -> bool:
        """Whether every parameter of module `owner` (its own, not its children's) is loaded."""
        own = [n for n in self.params if n.rpartition(".")[0] == owner]
        return bool(own) and all(self.filled[n] == self.sizes[n] for n in own)

    def release(self, owner: str) -> None:
        """Forget module `owner`'s parameters (complete: the module was replaced, e.g.
        quantized), so that this filler holds no reference to them."""
        for name in [n for n in self.params if n.rpartition(".")[0] == owner]:
            del self.params[name]
            self.sources.pop(name, None)
            self.pending.pop(name, None)

    def check_complete(self) -> None:
        missing = sorted(n for n, size in self.sizes.items() if self.filled[n] < size)
        if missing:
            raise ValueError(f"checkpoint: missing parameters {missing[:5]}")


def empty_parameters(model: nn.Module, dtype_of: Callable[[nn.Module], torch.dtype | None]) -> None:
    """Each floating-point parameter of each module for which `dtype_of` gives a dtype (integer
    ones stay as they are, as `Module.to` leaves them) replaced by a new,
    uninitialised tensor of its shape in that dtype (one for a parameter two modules share):
    before the load fills every parameter (a parameter left unfilled is an error), converting
    the old values would only write memory the load writes again."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        dtype = dtype_of(module)
        if dtype is None:
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_floating_point():
                continue
            if id(param) not in made:
                empty = torch.empty(param.shape, dtype=dtype)
                made[id(param)] = nn.Parameter(empty, requires_grad=param.requires_grad)
            setattr(module, name, made[id(param)])
