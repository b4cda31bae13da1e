"""FP8 (e4m3) storage of hidden states: one float32 scale per token, speculators' own math.

quantize_fp8 is hs_connectors.fp8_utils.quantize_tensor_to_fp8 (speculators 0.9), re-stated so the
capture needs no speculators install (tests/test_fp8.py checks the two agree bit for bit):
scale = max(amax / 448, 1e-12) over every non-token dimension; fp8 = (x / scale) cast to e4m3fn.
A shard's layer file quantizes each layer on its own (a [T, H] tensor: scale [T, 1]); the speculators
export stacks those bytes and scales ([T, L, H], [T, L, 1]) without rounding them again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FP8_DTYPE = "float8_e4m3fn"
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# float32(1 / 448): torch on a CUDA tensor computes `amax / FP8_MAX` as amax x this (its CPU-scalar divisor path)
INV_MAX = 0.0022321429569274187
SCALE_MIN = 1e-12  # an all-zero token keeps a finite scale (its values are 0 whatever the scale)
SCALES_KEY = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY
# Rows quantized at once on the device: the temporaries are QUANT_CHUNK x H x 7 bytes (Kimi, H 7168: 196 MiB),
# allocated outside what vLLM's memory profile saw.
QUANT_CHUNK = 4096


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, float32 scale) of `x` [T, ...], on x's device; scale [T, 1, ...] (keepdim)."""
    import torch

    dims = tuple(range(1, x.dim()))
    # amax in x's own dtype is exact and its temporary half the size; copy=True: an fp32 `x` is not divided in place.
    amax = x.abs().amax(dim=dims, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=SCALE_MIN)
    return x.to(torch.float32, copy=True).div_(scale).to(torch.float8_e4m3fn), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """q x scale computed in float32 (speculators multiplies in bf16, which rounds the scale too),
    then cast to `dtype` (float32 when None)."""
    import torch

    out = q.float() * scale.float()
    return out if dtype in (None, torch.float32) else out.to(dtype)


def roundtrip_fp8(x: torch.Tensor) -> torch.Tensor:
    """x through FP8 storage and back (float32): what a right FP8 capture of `x` would read as."""
    return dequantize_fp8(*quantize_fp8(x))


def rounding_draw(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A value FP8 storage could have rounded to `x` (float32): `x` requantized (a no-op on values read
    from an FP8 file), each value moved by a uniform draw within its rounding interval (half a grid step
    either side). Where no reference state exists to quantize (the logits check), this measures what
    FP8 rounding alone does downstream."""
    import torch

    q, scale = quantize_fp8(x)
    v = q.float()
    mag = v.abs()
    # e4m3 has 3 mantissa bits: the grid step is 2^(exponent - 3); subnormals (|v| < 2^-6) step 2^-9.
    # Below a power of two the grid is twice as fine, so the interval is half as wide on that side.
    exp = torch.floor(torch.log2(mag.clamp_min(2.0**-6)))
    step = torch.exp2(exp - 3)
    below = torch.where((mag == torch.exp2(exp)) & (mag > 2.0**-6), step / 2, step)
    u = torch.rand(v.shape, generator=generator, dtype=torch.float32, device=v.device) - 0.5
    moved = mag + torch.where(u < 0, u * below, u * step)
    return torch.where(v < 0, -moved, moved) * scale
