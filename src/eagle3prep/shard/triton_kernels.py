"""The Triton kernels of kernels.py (imported only where Triton is): the MXFP4 and FP8 encodes, each one pass over
its rows. Every step is the reference's (mxfp4.quantize_mxfp4, fp8.quantize_fp8) on the same float32 values:
integer bit arithmetic for MXFP4's exponents and signs, IEEE-rounded divisions (div_rn) for FP8's, and torch's own
float32 -> e4m3fn conversion (c10's fp8e4m3fn_from_fp32_value) written out in integers. bfloat16 and float32 rows
come in as their bits (the interpreter's bfloat16 conversion mishandles subnormals; on the GPU it is the same shift).
"""

import triton
import triton.language as tl


@triton.jit
def _f32_bits(ptrs, mask, IN_BITS: tl.constexpr):
    """float32 bits (int32) of the rows: IN_BITS 16, bfloat16 given as int16; 32, float32 as int32; 0, any float."""
    if IN_BITS == 16:
        return tl.load(ptrs, mask=mask, other=0).to(tl.int32) << 16
    elif IN_BITS == 32:
        return tl.load(ptrs, mask=mask, other=0)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)


@triton.jit
def mxfp4_kernel(x_ptr, q_ptr, s_ptr, n, h, stride_x, ROWS: tl.constexpr, COLS: tl.constexpr, IN_BITS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    mask = (rows[:, None] < n) & (cols[None, :] < h)
    bits = _f32_bits(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask, IN_BITS)
    abs_bits = bits & 0x7FFFFFFF  # ordered as |x|: NaN > Inf > finite
    blocks = tl.reshape(abs_bits, (ROWS, COLS // 32, 32))
    amax = tl.max(blocks, axis=2)  # [ROWS, COLS / 32] int32
    e = (amax >> 23) - 129 + ((amax & 0x7FFFFF) > 0x400000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -127), 127)
    e = tl.where(amax != 0, e, 0)
    finite = amax < 0x7F800000
    inv = (tl.minimum(tl.maximum(127 - e, 0), 254) << 23).to(tl.float32, bitcast=True)
    y = tl.reshape(bits.to(tl.float32, bitcast=True), (ROWS, COLS // 32, 32)) * inv[:, :, None]
    a = tl.abs(y)
    code = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    code = code | ((tl.reshape(bits, (ROWS, COLS // 32, 32)) >> 28) & 8)  # x's sign bit
    code = tl.where(finite[:, :, None], code, 0)
    lo, hi = tl.split(tl.reshape(code, (ROWS, COLS // 2, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    pcols = tl.program_id(1) * (COLS // 2) + tl.arange(0, COLS // 2)
    pmask = (rows[:, None] < n) & (pcols[None, :] < h // 2)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * (h // 2) + pcols[None, :], packed, mask=pmask)
    scale = tl.where(finite, e + 127, 255).to(tl.uint8)
    scols = tl.program_id(1) * (COLS // 32) + tl.arange(0, COLS // 32)
    smask = (rows[:, None] < n) & (scols[None, :] < h // 32)
    tl.store(s_ptr + rows[:, None].to(tl.int64) * (h // 32) + scols[None, :], scale, mask=smask)


@triton.jit
def fp8_kernel(
    x_ptr, q_ptr, s_ptr, h, stride_x, inv_max, BLOCK_H: tl.constexpr, IN_BITS: tl.constexpr, BY_INVERSE: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < h
    bits = _f32_bits(x_ptr + row * stride_x + cols, mask, IN_BITS)
    amax = tl.max(bits & 0x7FFFFFFF, axis=0).to(tl.float32, bitcast=True)  # ordered as |x|: a NaN wins
    # torch's `amax / 448.0` on a CUDA tensor multiplies by the float32 inverse (a CPU scalar divisor), on the CPU
    # it divides: BY_INVERSE follows the device the reference would run on
    if BY_INVERSE:  # noqa: SIM108 - a constexpr branch, as measured on the GPU
        scale = amax * inv_max
    else:
        scale = tl.math.div_rn(amax, 448.0)
    scale = tl.where(scale < 1e-12, 1e-12, scale)  # a NaN scale stays NaN, as torch's clamp keeps it
    # the row's scale broadcast to the row explicitly, as div_rn's operands
    qb = tl.math.div_rn(bits.to(tl.float32, bitcast=True), tl.broadcast_to(scale, (BLOCK_H,)))
    qb = qb.to(tl.int32, bitcast=True)
    # c10's fp8e4m3fn_from_fp32_value: >= 480 (and Inf, NaN) -> NaN; below 2^-6 rounded by a float add; else
    # round to nearest even on the bits
    mag = qb & 0x7FFFFFFF
    sub = ((mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)) & 0xFF
    nrm = ((mag + ((7 - 127) << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20) & 0xFF
    q = tl.where(mag >= (1087 << 20), 0x7F, tl.where(mag < (121 << 23), sub, nrm)) | ((qb >> 24) & 0x80)
    tl.store(q_ptr + row * h + cols, q.to(tl.uint8), mask=mask)
    tl.store(s_ptr + row, scale)
