"""MXFP4 weights (OCP Microscaling FP4), as DeepSeek-V4-Flash ships its routed experts
(config.json `expert_dtype: "fp4"`), and the e8m0 scales they and the `scale_fmt: "ue8m0"` fp8
weights use. Pure functions; thermostat.models.fp8_weights dequantizes with them at load.

| tensor   | dtype                                  | shape            | holds                    |
|----------|----------------------------------------|------------------|--------------------------|
| X.weight | int8 / uint8 / float4_e2m1fn_x2        | [..., out, in/2] | two e2m1 codes per byte  |
| X.scale  | float8_e8m0fnu (uint8: the same bytes) | [..., out, in/32]| one 2**k per 32 inputs   |

Byte j of a row holds inputs 2j (low nibble, bits 3..0) and 2j+1 (high nibble, bits 7..4): the
packing of torch.float4_e2m1fn_x2 (c10/util/Float4_e2m1fn_x2.h: "val1 : val0" from MSB to LSB),
of transformers' FP4 unpacking (integrations/finegrained_fp8.py `_unpack_fp4`,
integrations/mxfp4.py) and of the published V4 inference ports (`codes & 0x0F` first). DeepSeek's
own inference/model.py declares the expert weight `[out, in // 2]` float4_e2m1fn_x2 with a
`[out, in // 32]` float8_e8m0fnu scale; transformers allocates the same weight as int8.

A nibble is sign(bit 3) | exponent(bits 2..1) | mantissa(bit 0), e2m1 without inf/nan:

| code (& 7) | 0 | 1   | 2 | 3   | 4 | 5 | 6 | 7 |
|------------|---|-----|---|-----|---|---|---|---|
| value      | 0 | 0.5 | 1 | 1.5 | 2 | 3 | 4 | 6 |

An e8m0 byte b is the scale 2**(b - 127) exactly (b = 0: 2**-127, a float32 subnormal; 255: NaN).
The weight is `value(code) * scale` of its 32-input block, exact in float32.
"""

from __future__ import annotations

import torch

BLOCK = 32  # inputs per e8m0 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # by the code's low three bits
PACKED_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
E2M1_MAX = 6.0

# quantize: a magnitude above threshold i (or at it, where the tie goes up to the even code)
# takes code i + 1; ties between neighbours round to the even code, as round-to-nearest-even does
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
               (3.5, True), (5.0, False))  # fmt: skip


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu or uint8 -> its bytes as uint8 (same shape)."""
    if scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"an e8m0 scale is float8_e8m0fnu or uint8, not {scale.dtype}")
    return scale.view(torch.uint8)


def e8m0_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 scales (float8_e8m0fnu, or uint8 holding the same bytes) -> float32 2**(b - 127),
    built from the bits: exact, byte 0 the subnormal 2**-127, byte 255 NaN."""
    b = e8m0_bytes(scale).to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 1 << 22), b << 23)  # 2**-127 = 0x00400000
    bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)  # quiet NaN
    return bits.view(torch.float32)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., out, in/2] packed e2m1 pairs and [..., out, in/32] e8m0 scales -> float32
    [..., out, in]. ValueError on a dtype or shape that is not this layout."""
    if packed.dtype not in PACKED_DTYPES:
        raise ValueError(f"MXFP4 weights are int8, uint8 or float4_e2m1fn_x2, not {packed.dtype}")
    if (
        packed.dim() < 2
        or tuple(scales.shape)
        != (
            *packed.shape[:-1],
            2 * packed.shape[-1] // BLOCK,
        )
        or (2 * packed.shape[-1]) % BLOCK
    ):
        raise ValueError(
            f"MXFP4 weight {tuple(packed.shape)} (two values per byte) needs scales "
            f"[..., out, in/{BLOCK}] with in divisible by {BLOCK}, got {tuple(scales.shape)}"
        )
    codes = packed.view(torch.uint8)
    codes = torch.stack((codes & 0x0F, codes >> 4), dim=-1).flatten(-2).long()  # low first
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    values = table[codes & 7]
    values = torch.where(codes >= 8, -values, values)
    scale = e8m0_to_float32(scales).repeat_interleave(BLOCK, dim=-1)
    return values * scale


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., out, in] (in divisible by 32) -> (uint8 [..., out, in/2] packed low nibble
    first, float8_e8m0fnu [..., out, in/32]). Each block's scale is the smallest power of two
    with |w| / scale <= 6 (DeepSeek's round-up-to-a-power-of-two scale); codes round to nearest,
    ties to even. Values already on that grid come back exactly from dequantize_mxfp4."""
    if weight.dim() < 2 or weight.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs [..., out, in] with in divisible by {BLOCK}")
    w = weight.double().reshape(*weight.shape[:-1], -1, BLOCK)
    amax = w.abs().amax(dim=-1)
    mantissa, exponent = torch.frexp(amax / E2M1_MAX)  # amax/6 = m * 2**e, m in [0.5, 1)
    k = torch.where(mantissa == 0.5, exponent - 1, exponent)  # ceil(log2(amax / 6))
    k = torch.where(amax == 0, torch.full_like(k, -127), k).clamp(-127, 127)
    scaled = (w / torch.pow(2.0, k.double()).unsqueeze(-1)).flatten(-2)
    magnitude = scaled.abs().clamp(max=E2M1_MAX)
    code = torch.zeros(magnitude.shape, dtype=torch.uint8)
    for threshold, tie_up in _THRESHOLDS:
        code += (magnitude >= threshold if tie_up else magnitude > threshold).to(torch.uint8)
    code = torch.where((scaled < 0) & (code > 0), code | 8, code)
    pairs = code.reshape(*code.shape[:-1], -1, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    scales = (k + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return packed, scales
