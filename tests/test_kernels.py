"""The storage encodes' Triton kernels (shard/kernels.py) against their references (mxfp4.quantize_mxfp4,
fp8.quantize_fp8), byte for byte, through Triton's interpreter on the CPU: the widths of an 8B and a Kimi-shaped
target, row counts that are no multiple of a kernel's tile, NaN / Inf / zero / subnormal / -0 blocks, and
bfloat16, float16 and float32 rows. The GPU comparison is bench/storage_formats.py's (its "byte identity" line).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3prep.shard import formats, fp8, kernels, mxfp4

# Triton picks its interpreter when it is imported: the kernels run in a child process started with
# TRITON_INTERPRET=1 (this process may have imported Triton already), on inputs this process made and compares.
CHILD = """
import sys, torch
from eagle3prep.shard import kernels
cases = torch.load(sys.argv[1])
out = {
    k: kernels.encode_mxfp4(x) if k[0] == "mxfp4" else kernels.encode_fp8(x, by_inverse=k[0] == "fp8-inverse")
    for k, x in cases.items()
}
torch.save(out, sys.argv[2])
"""


def run_kernels(cases: dict, tmp: Path) -> dict:
    """{key: the kernel's output} for {key: rows} with key[0] "mxfp4", "fp8" or "fp8-inverse" (the scale as torch
    computes it on a CUDA tensor), through the interpreter."""
    torch.save(cases, tmp / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp / "in.pt"), str(tmp / "out.pt")], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(tmp / "out.pt")


def hard_rows(tokens: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows spanning 1e-3..1e3, with a zero row, a -0 row, NaN and +-Inf blocks, a block of subnormals (float16:
    its own), a row far below 1 and exact e2m1 midpoints (ties) under a block scale of 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g) * torch.logspace(-3, 3, tokens)[:, None]
    x[5] = 0.0
    x[6] = -0.0
    x[9, 3] = float("nan")
    x[11, hidden - 1] = float("inf")
    x[12, 40 % hidden] = -float("inf")
    x[13, :32] = torch.linspace(-1, 1, 32) * (1e-39 if dtype != torch.float16 else 3e-6)
    x[14] *= 1e-30 if dtype != torch.float16 else 1e-3
    ties = torch.tensor([6.0, *mxfp4._MIDPOINTS] * 4)[:32]
    x[15, :32] = ties * torch.tensor([1.0, -1.0]).repeat(16)
    return x.to(dtype)


WIDTHS = {"H96": 96, "H4096": 4096, "H7168-kimi": 7168}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CASES = [*((w, d) for w in WIDTHS for d in DTYPES), ("strided", "bf16"), ("empty", "bf16")]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Each case's rows and the kernel's output on them: {key: (rows, output)}."""
    pytest.importorskip("triton", reason="triton is not installed here (envs/gpu.txt pins it for the GPU)")
    cases = {
        (fmt, w, d): hard_rows(19, hidden, dtype)  # 19 rows: no multiple of the MXFP4 kernel's 4
        for fmt in ("mxfp4", "fp8")
        for w, hidden in WIDTHS.items()
        for d, dtype in DTYPES.items()
    }
    wide = hard_rows(17, 4096 + 64, torch.bfloat16)
    for fmt in ("mxfp4", "fp8"):
        cases[(fmt, "strided", "bf16")] = wide[:, 64:]  # a row stride of 4160, as a slice of a wider buffer
        cases[(fmt, "empty", "bf16")] = wide[:0, 64:]
    out = run_kernels(cases, tmp_path_factory.mktemp("kernels"))
    return {k: (x, out[k]) for k, x in cases.items()}


@pytest.mark.parametrize(("width", "dtype"), CASES, ids="-".join)
def test_mxfp4_kernel_is_the_reference_byte_for_byte(outputs, width, dtype):
    x, (packed, scales) = outputs[("mxfp4", width, dtype)]
    ref_packed, ref_scales = mxfp4.quantize_mxfp4(x.contiguous())
    assert packed.shape == ref_packed.shape and scales.shape == ref_scales.shape
    assert torch.equal(packed, ref_packed) and torch.equal(scales, ref_scales)
    if width in WIDTHS:
        assert int(scales[9, 0]) == int(scales[11, -1]) == mxfp4.SCALE_NAN  # the planted blocks are compared
        assert bool((mxfp4.codes_of(packed)[6] == 8).all())  # -0 keeps its sign bit


@pytest.mark.parametrize(("width", "dtype"), CASES, ids="-".join)
def test_fp8_kernel_is_the_reference_byte_for_byte(outputs, width, dtype):
    x, (values, scales) = outputs[("fp8", width, dtype)]
    ref_values, ref_scales = fp8.quantize_fp8(x)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == ref_scales.shape == (len(x), 1)
    assert torch.equal(values.view(torch.uint8), ref_values.view(torch.uint8))
    # bit for bit, but a NaN scale's payload (a NaN token's) is the platform's: compared as NaN
    nan = ref_scales.isnan()
    assert torch.equal(scales.isnan(), nan) and torch.equal(
        scales[~nan].view(torch.int32), ref_scales[~nan].view(torch.int32)
    )


def test_fp8_kernel_scales_as_torch_does_on_cuda(tmp_path):
    """On a CUDA tensor torch computes `amax / 448.0` as amax x float32(1 / 448) (its CPU-scalar divisor path), which
    differs from the division on some rows: the kernel's BY_INVERSE mode is that torch, byte for byte (emulated here
    in float32 on the CPU), and the two modes are told apart on these rows."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(512, 96, generator=g) * torch.logspace(-3, 3, 512)[:, None]).to(torch.bfloat16)
    amax = x.abs().amax(dim=1, keepdim=True).float()
    by_division, by_inverse = amax / fp8.FP8_MAX, amax * torch.tensor(fp8.INV_MAX)
    assert (by_division != by_inverse).any()  # the rows where the two scales part
    scale = by_inverse.clamp(min=fp8.SCALE_MIN)
    ref = (x.float() / scale).to(torch.float8_e4m3fn)
    out = run_kernels({("fp8-inverse", "H96", "bf16"): x, ("fp8", "H96", "bf16"): x}, tmp_path)
    values, scales = out[("fp8-inverse", "H96", "bf16")]
    assert torch.equal(scales, scale) and torch.equal(values.view(torch.uint8), ref.view(torch.uint8))
    assert not torch.equal(out[("fp8", "H96", "bf16")][1], scale)  # the CPU's division, the other scale


def test_the_comparison_sees_a_rounding_mistake(outputs):
    """Ties toward zero (the rounding this format once had) differ from the kernel on the planted midpoints: the
    byte comparison above would fail on it."""
    x, (packed, _) = outputs[("mxfp4", "H96", "bf16")]
    n, h = x.shape
    e = mxfp4.block_exponents(x)
    y = x.float().view(n, h // 32, 32) * torch.exp2(-e.float()).unsqueeze(-1)
    toward_zero = torch.bucketize(y.abs().nan_to_num(0.0), torch.tensor(mxfp4._MIDPOINTS)).view(n, h)
    assert not torch.equal(mxfp4.codes_of(packed)[15] & 7, toward_zero[15].to(torch.uint8))


def test_the_format_uses_the_kernel_only_on_cuda(monkeypatch):
    x = hard_rows(16, 96, torch.bfloat16)
    assert not kernels.available(x)  # a CPU tensor: the reference, even under the interpreter
    calls = []
    monkeypatch.setattr(kernels, "encode_mxfp4", lambda t: calls.append(t) or mxfp4.quantize_mxfp4(t))
    monkeypatch.setattr(kernels, "available", lambda t: True)
    assert torch.equal(formats.storage_format("mxfp4").encode(x)[0], mxfp4.quantize_mxfp4(x)[0]) and calls


def test_without_triton_the_reference_serves(monkeypatch):
    """Where Triton does not import (the CPU install), the formats encode through the reference."""
    real = __import__

    def no_triton(name, *args, **kwargs):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr("builtins.__import__", no_triton)
    kernels._triton.cache_clear()
    try:
        assert kernels._triton() is None
        x = hard_rows(16, 96, torch.bfloat16)
        assert torch.equal(formats.storage_format("mxfp4").encode(x)[1], mxfp4.quantize_mxfp4(x)[1])
    finally:
        monkeypatch.undo()
        kernels._triton.cache_clear()


def test_a_kernel_that_cannot_run_leaves_the_reference_said_once(monkeypatch, caplog):
    """A Triton that cannot build a kernel here: the format encodes through the reference (the same bytes), and
    the log says so once."""
    import logging

    x = hard_rows(16, 96, torch.bfloat16)
    calls = []

    def broken(t):
        calls.append(t)
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(kernels, "available", lambda t: True)
    monkeypatch.setattr(kernels, "FAILED", {})
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert torch.equal(
                kernels._guarded("mxfp4", broken, mxfp4.quantize_mxfp4, x)[0], mxfp4.quantize_mxfp4(x)[0]
            )
    assert len(calls) == 1 and "PTX assembly failed" in kernels.FAILED["mxfp4"]
    assert sum("mxfp4 encode kernel cannot run here" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("in_bits", [16, 32, 0], ids=["bf16", "fp32", "fp16"])
def test_the_kernels_build_for_hopper(in_bits):
    """Both kernels compile for sm_90 (H100/H200) down to machine code, here without a GPU (Triton's own ptxas),
    so a lowering the interpreter accepts and the compiler refuses fails on the CPU; FP8's divisions are the
    IEEE-rounded ones that keep subnormals (div.rn.f32, no .ftz), as torch's."""
    triton = pytest.importorskip("triton", reason="triton is not installed here (envs/gpu.txt pins it for the GPU)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from eagle3prep.shard import triton_kernels as tk

    ptr = {16: "*i16", 32: "*i32", 0: "*fp16"}[in_bits]
    target = GPUTarget("cuda", 90, 32)
    common = {"x_ptr": ptr, "q_ptr": "*u8", "stride_x": "i32", "h": "i32", "IN_BITS": "constexpr"}
    mx = ASTSource(
        fn=tk.mxfp4_kernel,
        signature={**common, "s_ptr": "*u8", "n": "i32", "ROWS": "constexpr", "COLS": "constexpr"},
        constexprs={"ROWS": kernels.MX_ROWS, "COLS": kernels.MX_COLS, "IN_BITS": in_bits},
    )
    assert triton.compile(mx, target=target, options={"num_warps": kernels.MX_WARPS}).asm["cubin"]
    for block in (4096, 8192):  # hidden 4,096 and 7,168
        src = ASTSource(
            fn=tk.fp8_kernel,
            signature={
                **common,
                "s_ptr": "*fp32",
                "inv_max": "fp32",
                "BLOCK_H": "constexpr",
                "BY_INVERSE": "constexpr",
            },
            constexprs={"BLOCK_H": block, "IN_BITS": in_bits, "BY_INVERSE": True},
        )
        ptx = triton.compile(src, target=target, options={"num_warps": kernels.FP8_WARPS[block > 4096]}).asm["ptx"]
        divs = {line.split()[0] for line in ptx.splitlines() if line.strip().startswith("div")}
        assert divs == {"div.rn.f32"}
