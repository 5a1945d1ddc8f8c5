"""What reading GPTQ, AWQ and compressed-tensors checkpoints shares: `PackedLinears` collects
each quantized linear layer's tensors (any order, any shard) and yields its weight dequantized
to float32 under the plain name, once all have come; a format names its parts and dequantizes
them (thermostat.models.int_packing). Plus the refusal naming a quantization_config field, and
the engine format a checkpoint is served in by default."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

Tensors = Iterable[tuple[str, torch.Tensor]]


def refuse(field: str, value: object, served: str) -> ValueError:
    return ValueError(
        f"config.json: quantization_config.{field}={value!r} is not supported "
        f"(Thermostat loads {served})"
    )


def int4_or_int8(bits: int, group_size: int, act_order: bool) -> str:
    """int4 where every block of 32 inputs has one scale and zero point, else int8."""
    whole_blocks = group_size == -1 or group_size % 32 == 0
    return "int4" if bits == 4 and whole_blocks and not act_order else "int8"


def groups_name(group_size: int) -> str:
    return "per-channel" if group_size == -1 else f"g{group_size}"


class PackedLinears:
    """Collects each quantized layer's tensors (in any order, any shard) and yields its
    dequantized weight once all have come; a format names its parts and dequantizes."""

    def part(self, name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
        """(layer, part) for a quantized layer's tensor, None for any other tensor."""
        raise NotImplementedError

    def parts(self, layer: str) -> tuple[frozenset[str], frozenset[str]]:
        """(required, optional) parts of `layer`."""
        raise NotImplementedError

    def dequantize(self, layer: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """float32 [N, K]; ValueError naming what does not fit."""
        raise NotImplementedError

    def read(self, tensors: Tensors) -> Iterator[tuple[str, torch.Tensor]]:
        """ValueError naming a layer missing a part, or a checkpoint with no quantized layer
        (a float checkpoint under a quantization_config)."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        layers = 0
        for name, tensor in tensors:
            found = self.part(name, tensor)
            if found is None:
                yield name, tensor
                continue
            layer, part = found
            have = pending.setdefault(layer, {})
            have[part] = tensor
            required, optional = self.parts(layer)
            if have.keys() >= required | optional:
                layers += 1
                yield self._weight(layer, pending.pop(layer))
        for layer, have in pending.items():  # an optional part never came
            missing = self.parts(layer)[0] - have.keys()
            if missing:
                raise ValueError(f"checkpoint: {layer} has {sorted(have)} but no {sorted(missing)}")
            layers += 1
            yield self._weight(layer, have)
        if not layers:
            raise ValueError(
                f"checkpoint: no {type(self).__name__} layer in the weights, though config.json's "
                "quantization_config names that quantization"
            )

    def _weight(self, layer: str, parts: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
        try:
            return f"{layer}.weight", self.dequantize(layer, parts)
        except (ValueError, RuntimeError, IndexError) as exc:
            shapes = {p: tuple(t.shape) for p, t in parts.items()}
            raise ValueError(f"checkpoint: {layer} {shapes}: {exc}") from exc


def layer_part(name: str, suffixes: tuple[str, ...]) -> tuple[str, str] | None:
    layer, _, part = name.rpartition(".")
    return (layer, part) if layer and part in suffixes else None
