"""MXFP4 storage of hidden states: 4-bit e2m1 values, one power-of-two (e8m0) scale per block of 32.

The element and scale encodings are the OCP Microscaling (MX) v1.0 ones: e2m1 holds +-{0, 0.5, 1, 1.5, 2, 3, 4,
6}, the e8m0 byte b stands for 2^(b - 127). One choice differs from the spec's reference quantizer: the scale is
rounded *up* (the smallest power of two with amax / scale <= 6), so no value of a block clips. A hidden state's
large outliers are the values a trainer least wants moved; the spec's floor(log2(amax)) - 2 clips them by up
to 25 %. Each value divided by its scale is rounded to nearest, ties to the even code (OCP's rounding, as
ml_dtypes' float4_e2m1fn does), and keeps its sign bit (a negative value that rounds to zero is stored as -0).

A layer file holds `hidden_states` [T, H / 2] uint8 (element 2i in the low nibble, 2i + 1 in the high one; bit 3
of a nibble is the sign) and `hidden_states_scales` [T, H / 32] uint8. A decoded value is an e2m1 value times a
power of two, exact in bfloat16 and float32: decoding loses nothing beyond the encoding. A block holding a NaN or
an Inf gets the scale 255 (NaN: every value of it reads back NaN) and the codes 0.

This is the reference encode (any device, the CPU's path); shard/kernels.py is the same encode as one Triton
kernel on CUDA, byte for byte (tests/test_kernels.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BLOCK = 32  # values a scale covers (MX's k)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of codes 0..7
E2M1_MAX = 6.0
SCALE_BIAS = 127  # e8m0: byte b = 2^(b - 127)
SCALE_NAN = 255  # e8m0's NaN: a block holding a NaN or an Inf reads back as NaN, so validation still sees it
# Round to nearest, ties to even: the midpoint between codes i and i + 1 goes to the even one, so a magnitude
# counts past a midpoint when it is above it (i even) or at least it (i odd).
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1, E2M1[1:], strict=False))
ROUNDING = "round to nearest, ties to even (OCP MX v1.0; ml_dtypes float4_e2m1fn)"
EXP_MASK, MANT_HALF = 0x7F800000, 0x400000  # float32: exponent bits; the mantissa bits of 1.5


def _table(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    import torch

    return torch.tensor(values, dtype=torch.float32, device=device)


def check_width(hidden_size: int) -> None:
    if hidden_size % BLOCK:
        raise ValueError(
            f"mxfp4 storage needs a hidden size that is a multiple of {BLOCK}; this model's is {hidden_size}"
        )


def _abs_bits(x: torch.Tensor) -> torch.Tensor:
    """|x| as float32 bits (int32): ordered as the magnitudes are, NaN above Inf above every finite value."""
    import torch

    return x.float().view(torch.int32) & 0x7FFFFFFF


def block_exponents(x: torch.Tensor) -> torch.Tensor:
    """[n, H / 32] int32: each block's scale exponent, the smallest e with amax / 2^e <= 6, from amax's float32
    bits (exact, no division): amax = 1.m x 2^E fits under 6 x 2^e = 1.5 x 2^(e + 2) with e = E - 2 when
    1.m <= 1.5, else E - 1. A block of subnormals gets the smallest scale, 2^-127; an all-zero block 2^0 (its
    codes are 0 whatever the scale)."""
    n, h = x.shape
    return _exponents_of(_abs_bits(x).view(n, h // BLOCK, BLOCK).amax(-1))


def _exponents_of(amax_bits: torch.Tensor) -> torch.Tensor:
    e = (amax_bits >> 23) - 129 + ((amax_bits & 0x7FFFFF) > MANT_HALF).int()
    return (e.clamp(-SCALE_BIAS, SCALE_BIAS) * (amax_bits != 0)).int()


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e (float32) for e in [-126, 127], built from its bits (exact on every device)."""
    import torch

    return ((e + 127).clamp(0, 254) << 23).int().view(torch.float32)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed values [n, H / 2] uint8, e8m0 scales [n, H / 32] uint8) of `x` [n, H], on x's device."""
    import torch

    n, h = x.shape
    xf = x.float().view(n, h // BLOCK, BLOCK)
    amax_bits = _abs_bits(xf).amax(-1)
    e = _exponents_of(amax_bits)
    finite = amax_bits < EXP_MASK
    a = (xf * _pow2(-e).unsqueeze(-1)).abs()  # |y| <= 6: a power of two moves no bit of a normal result
    codes = sum((a >= m if i % 2 else a > m).to(torch.uint8) for i, m in enumerate(_MIDPOINTS))
    codes |= (xf.view(torch.int32) < 0).to(torch.uint8) << 3  # x's sign bit
    codes = torch.where(finite.unsqueeze(-1), codes, 0).view(n, h // 2, 2)
    scales = torch.where(finite, e + SCALE_BIAS, SCALE_NAN).to(torch.uint8)
    return codes[..., 0] | (codes[..., 1] << 4), scales


def codes_of(packed: torch.Tensor) -> torch.Tensor:
    """[n, H] uint8 codes (sign in bit 3) from the packed [n, H / 2] bytes."""
    import torch

    return torch.stack((packed & 15, packed >> 4), dim=-1).view(packed.shape[0], -1)


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """[n, H / 32, 1] float32 powers of two of the e8m0 bytes (NaN for SCALE_NAN)."""
    import torch

    power = torch.exp2(scales.float() - SCALE_BIAS)
    return torch.where(scales == SCALE_NAN, float("nan"), power).unsqueeze(-1)


def _pairs(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: the two values (low nibble, high nibble) of every packed byte, unscaled."""
    import torch

    signed = _table(E2M1 + tuple(-v for v in E2M1), device)
    byte = torch.arange(256, device=device)
    return torch.stack((signed[byte & 15], signed[byte >> 4]), dim=-1)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[n, H] values (float32 when `dtype` is None; exact in bfloat16 too), on the inputs' device.
    One gather a byte (a 256-entry table of value pairs) keeps the trainer's loader cheap; for bfloat16 the pair
    is gathered as one 32-bit word and scaled in bfloat16 (a power of two: exact), a quarter of float32's traffic."""
    import torch

    n, half = packed.shape
    if dtype == torch.bfloat16:
        words = _pairs(packed.device).to(torch.bfloat16).view(torch.int32).view(256)
        values = words[packed.long()].view(torch.bfloat16).view(n, half * 2 // BLOCK, BLOCK)
        return (values * scale_values(scales).to(torch.bfloat16)).view(n, half * 2)
    values = _pairs(packed.device)[packed.long()].view(n, half * 2 // BLOCK, BLOCK)
    out = (values * scale_values(scales)).view(n, half * 2)
    return out if dtype in (None, torch.float32) else out.to(dtype)


def roundtrip_mxfp4(x: torch.Tensor) -> torch.Tensor:
    return dequantize_mxfp4(*quantize_mxfp4(x))


def rounding_draw_mxfp4(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A value MXFP4 storage could have rounded to `x` (float32): `x` requantized, each value moved by a uniform
    draw within its code's rounding interval (half the gap to each neighbouring code, the block's scale kept).
    The top code has no interval above it: the scale is rounded up, so no block value exceeds it."""
    import torch

    packed, scales = quantize_mxfp4(x)
    codes = codes_of(packed).long()
    mag_code, negative = codes & 7, codes >= 8
    grid = _table(E2M1, x.device)
    below = _table((0.5, *(b - a for a, b in zip(E2M1, E2M1[1:], strict=False))), x.device)[mag_code]
    above = _table((*(b - a for a, b in zip(E2M1, E2M1[1:], strict=False)), 0.0), x.device)[mag_code]
    u = torch.rand(codes.shape, generator=generator, dtype=torch.float32, device=x.device) - 0.5
    moved = grid[mag_code] + torch.where(u < 0, u * below, u * above)
    n, h = codes.shape
    signed = torch.where(negative, -moved, moved).view(n, h // BLOCK, BLOCK)
    return (signed * scale_values(scales)).view(n, h)
