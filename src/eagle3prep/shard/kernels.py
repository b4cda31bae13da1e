"""The storage encodes as fused Triton kernels: one pass over the rows on their GPU, byte for byte the reference
encodes of mxfp4.py and fp8.py (tests/test_kernels.py runs both kernels through Triton's interpreter on the CPU;
bench/storage_formats.py compares them on the GPU and times them).

    encode_mxfp4(x) -> (packed [n, H / 2] uint8, scales [n, H / 32] uint8)
    encode_fp8(x)   -> (values [n, H] float8_e4m3fn, scales [n, 1] float32)

`available(x)` says whether the kernels serve `x` (rows [n, H] on CUDA, Triton importable); formats.py falls back
to the reference otherwise. encode_* run any tensor under TRITON_INTERPRET=1 (the tests' path). Triton is imported,
and the kernels made (triton_kernels.py), on the first call.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ..infra.log import get_logger
from . import fp8, mxfp4

if TYPE_CHECKING:
    import torch

log = get_logger("extract")
MX_COLS = 1024  # columns of a MXFP4 program's tile: 32 blocks (H 4096: 4 tiles a row; 7168: 7)
MX_ROWS = 4
MX_WARPS = 4
FP8_WARPS = (8, 16)  # H up to 4096, wider


@functools.cache
def _triton() -> Any:
    """The kernels' module, or None where Triton does not import. Triton chooses its interpreter when it is first
    imported (TRITON_INTERPRET=1 then: the tests' child process)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from . import triton_kernels

    return triton_kernels


def available(x: torch.Tensor) -> bool:
    """Whether the kernels serve `x`: rows [n, H] on CUDA, with Triton importable."""
    return x.dim() == 2 and x.is_cuda and _triton() is not None


def _bits_view(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`x` as the kernels take it: bfloat16 and float32 as their bits (IN_BITS 16, 32), other floats as they are."""
    import torch

    if x.dtype == torch.bfloat16:
        return x.view(torch.int16), 16
    if x.dtype == torch.float32:
        return x.view(torch.int32), 32
    return x, 0


def encode_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mxfp4.quantize_mxfp4(x) in one kernel: (packed [n, H / 2] uint8, scales [n, H / 32] uint8)."""
    import torch

    k = _triton()
    n, h = x.shape
    mxfp4.check_width(h)
    x = x if x.stride(1) == 1 else x.contiguous()
    q = torch.empty((n, h // 2), dtype=torch.uint8, device=x.device)
    s = torch.empty((n, h // mxfp4.BLOCK), dtype=torch.uint8, device=x.device)
    if n:
        grid = (-(-n // MX_ROWS), -(-h // MX_COLS))
        xb, in_bits = _bits_view(x)
        k.mxfp4_kernel[grid](
            xb, q, s, n, h, x.stride(0), ROWS=MX_ROWS, COLS=MX_COLS, IN_BITS=in_bits, num_warps=MX_WARPS
        )
    return q, s


def encode_fp8(x: torch.Tensor, by_inverse: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_fp8(x) for rows [n, H] in one kernel: (values [n, H] float8_e4m3fn, scales [n, 1] float32).
    by_inverse: the scale as amax x float32(1 / 448), as torch computes `amax / 448.0` on a CUDA tensor; None follows
    x's device (on the CPU torch divides)."""
    import torch

    k = _triton()
    n, h = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    q = torch.empty((n, h), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((n, 1), dtype=torch.float32, device=x.device)
    if n:
        block = 1 << (h - 1).bit_length()
        xb, in_bits = _bits_view(x)
        inverse = x.is_cuda if by_inverse is None else by_inverse
        k.fp8_kernel[(n,)](xb, q.view(torch.uint8), s, h, x.stride(0), fp8.INV_MAX, BLOCK_H=block, IN_BITS=in_bits,
                           BY_INVERSE=inverse, num_warps=FP8_WARPS[block > 4096])  # fmt: skip
    return q, s


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 encode: the kernel where it serves `x`, else the reference."""
    return _guarded("fp8", encode_fp8, fp8.quantize_fp8, x)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MXFP4 encode: the kernel where it serves `x`, else the reference."""
    mxfp4.check_width(x.shape[-1])  # the caller's mistake, not a kernel that cannot run here
    return _guarded("mxfp4", encode_mxfp4, mxfp4.quantize_mxfp4, x)


FAILED: dict[str, str] = {}  # kernel -> why it could not run here (its format then encodes through the reference)


def _guarded(name: str, kernel: Any, reference: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernel(x)` where it serves `x`; a Triton that cannot build or launch it here (a version or device it does
    not support) leaves the reference, whose bytes are the same, said once in the log."""
    import torch

    if name not in FAILED and available(x):
        try:
            return kernel(x)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - any build or launch failure; the reference writes the same bytes
            FAILED[name] = f"{type(e).__name__}: {e}"[:500]
            log.warning(f"the {name} encode kernel cannot run here ({FAILED[name]}); encoding with torch instead")
    return reference(x)
