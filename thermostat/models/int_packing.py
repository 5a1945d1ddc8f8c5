"""How GPTQ, AWQ and compressed-tensors pack integer weights into int32 words, undone (pure
functions). W is a linear layer's weight [N out, K in]; b the bits; G the groups along K.

| checkpoint          | tensor            | shape               | field i of word w (bits b i)   |
|---------------------|-------------------|---------------------|--------------------------------|
| GPTQ                | qweight           | [K b / 32, N]       | row (32 / b) w + i (W^T)       |
| GPTQ                | qzeros            | [G, N b / 32]       | column (32 / b) w + i          |
| AWQ (version gemm)  | qweight           | [K, N / 8]          | column 8 w + AWQ_ORDER[i]      |
| AWQ                 | qzeros            | [G, N / 8]          | the same                       |
| compressed-tensors  | weight_packed     | [N, ceil(K b / 32)] | column (32 / b) w + i: q + 2^b/2 |
| (pack-quantized)    | weight_zero_point | [ceil(N b / 32), G] | row (32 / b) w + i: z + 2^b/2  |

Every format then reads w[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)], with g(k) = k // group
size or, where the checkpoint was quantized in activation order, `g_idx[k]`
(`dequantize_groups`). Where they differ: GPTQ's original ("v1") checkpoints store z - 1
(AutoGPTQ's kernels add the 1 back to the 4-bit field, so a stored 15 means 16), `gptq_v2` stores
z; AWQ stores z; compressed-tensors stores signed q and z (offset by 2^(b-1) when packed) and
omits z for symmetric weights.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column field i of an AWQ word holds


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their unsigned `bits`-bit fields as int32, field i of word w (bits
    [bits i, bits (i + 1))) at index (32 / bits) w + i along `dim`."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights are {packed.dtype}, expected torch.int32")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.movedim(dim, -1)
    fields = (words[..., None] >> shifts) & ((1 << bits) - 1)  # [..., W, 32 / bits]
    return fields.reshape(*words.shape[:-1], -1).movedim(-1, dim)


def awq_columns(unpacked: torch.Tensor) -> torch.Tensor:
    """AWQ's fields [R, 8 W] (as `unpack_int32` gives them along dim 1) in column order."""
    rows, cols = unpacked.shape
    inverse = [AWQ_ORDER.index(j) for j in range(8)]  # column j sits in field inverse[j]
    return unpacked.view(rows, cols // 8, 8)[:, :, inverse].reshape(rows, cols)


def dequantize_groups(
    q: torch.Tensor,
    zeros: torch.Tensor | None,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
) -> torch.Tensor:
    """q [N, K] integers, zeros [N, G] integers (None: 0), scales [N, G], g_idx [K] group of each
    input -> float32 [N, K] = (q - z) * s. Integers times a float16 or bfloat16 scale are exact
    in float32, so the result lies on the checkpoint's grid."""
    g = g_idx.long()
    centered = q.float() if zeros is None else (q.int() - zeros.int()[:, g]).float()
    return centered * scales.float()[:, g]


def contiguous_groups(k: int, group_size: int) -> torch.Tensor:
    """g_idx of groups of `group_size` consecutive inputs (-1: one group of all k)."""
    return torch.arange(k) // (k if group_size == -1 else group_size)
