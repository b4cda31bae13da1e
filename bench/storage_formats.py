"""Storage formats compared on the same hidden states: bytes per token, reconstruction error per layer, encode
cost on the device and decode cost in a trainer's loader (docs/guides/storage.md's table). On CUDA with Triton, the
encode is timed twice, the fused kernel (shard/kernels.py: what the capture runs) beside the torch reference, and
the two are compared byte for byte on the same rows (every layer, plus planted NaN / Inf / zero / subnormal / tie
rows): one "byte identity ... PASS" or "FAIL" line a format, and the exit status 1 on a FAIL.

    python bench/storage_formats.py --shard results/hidden_states/shard_0      # a captured shard's layers
    python bench/storage_formats.py --shape llama-8b   # (or kimi: hidden 7,168) a random Llama of that width

Formats: the project's (shard/formats.py) and candidates measured here only (NVFP4-style, int4 a token, MXFP4
with an FP8 last layer; the last layer as top-32 probabilities by its bytes alone), with what lossless zstd
(level 3, 1 MiB chunks) leaves. Error per token: |x - y| / |x| against the bf16 capture, per layer.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from eagle3prep.shard import formats, fp8, kernels, mxfp4
from eagle3prep.shard.manifest import read_manifest
from eagle3prep.shard.readers import LayerReader

TOKEN_ID_BYTES, TOPK = 8, 32  # top-k probabilities in place of the last layer: an int32 id and a bf16 each


def nvfp4_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """NVFP4-style: a float32 scale per token maps the token's largest block scale onto e4m3's 448, then each
    16-value block's e4m3 scale maps its amax onto 6."""
    n, h = x.shape
    b = x.float().view(n, h // 16, 16)
    block = b.abs().amax(-1, keepdim=True) / 6
    tok = (block.amax(1, keepdim=True) / 448).clamp_min(1e-30)
    s = (block / tok).to(torch.float8_e4m3fn).float().clamp_min(2.0**-9) * tok
    y = (b / s).clamp(-6, 6)  # rounded to e2m1 with the product's table and tie rule
    e2m1 = torch.tensor(mxfp4.E2M1, device=x.device)[
        torch.bucketize(y.abs(), torch.tensor(mxfp4._MIDPOINTS, device=x.device))
    ]
    return (e2m1 * y.sign() * s).view(n, h)


def int4_token_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """Symmetric int4, one scale per token (absmax / 7): one outlier sets the step of every value."""
    s = (x.float().abs().amax(-1, keepdim=True) / 7).clamp_min(1e-30)
    return (x.float() / s).round().clamp(-7, 7) * s


def zstd_ratio(name: str, x: torch.Tensor) -> float | None:
    """What zstd leaves of a layer's bytes in one of the project's formats (None: no zstandard installed)."""
    try:
        import zstandard
    except ImportError:
        return None
    blob = b"".join(
        p.contiguous().view(torch.uint8).cpu().numpy().tobytes() for p in formats.storage_format(name).encode(x)
    )
    c, chunk = zstandard.ZstdCompressor(level=3), 1 << 20
    return sum(len(c.compress(blob[i : i + chunk])) for i in range(0, len(blob), chunk)) / len(blob)


def timed(fn, *args, device: str, repeat: int = 3) -> float:
    """Best of `repeat` seconds (device-synchronized)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn(*args)
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def timed_loop(fn, *args, device: str, loops: int = 20) -> float:
    """Best of 3 mean seconds a call over `loops` calls (device-synchronized): kernels of ~0.1 ms need a loop."""
    fn(*args)  # compiled and warm
    return timed(lambda: [fn(*args) for _ in range(loops)], device=device) / loops


def planted_rows(hidden: int, device: str) -> torch.Tensor:
    """16 bf16 rows a kernel must get right: zero, -0, NaN, +-Inf, subnormals, tiny, huge, exact e2m1 ties."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, hidden, generator=g) * torch.logspace(-3, 3, 16)[:, None]
    x[1], x[2] = 0.0, -0.0
    x[3, 5], x[4, hidden - 1], x[5, 40] = float("nan"), float("inf"), -float("inf")
    x[6, :32] = torch.linspace(-1, 1, 32) * 1e-39
    x[7] *= 1e-30
    x[8] *= 1e30
    ties = torch.tensor([6.0, *mxfp4._MIDPOINTS] * 4)[:32]
    x[9, :32] = ties * torch.tensor([1.0, -1.0]).repeat(16)
    return x.to(device, torch.bfloat16)


def identical(name: str, ours: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> bool:
    """Byte for byte; an FP8 NaN token's scale compared as NaN (its payload is the platform's)."""
    ok = True
    for a, b in zip(ours, ref, strict=True):
        if name == "fp8_e4m3" and b.dtype == torch.float32:
            nan = b.isnan()
            ok &= torch.equal(a.isnan(), nan) and torch.equal(a[~nan], b[~nan])
        else:
            ok &= a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return bool(ok)


def where(name: str, kern, ref, sets: dict[str, torch.Tensor]) -> None:
    """Which rows differ, each set of rows against the reference on this device and on the CPU: whether the kernel
    or the device's own torch conversion leaves the CPU's bytes."""
    for label, r in sets.items():
        ours, here, cpu = kern(r), ref(r), ref(r.cpu())
        bad = [
            i
            for i in range(len(r))
            if not identical(name, tuple(t[i : i + 1] for t in ours), tuple(t[i : i + 1] for t in here))
        ]
        cpu_bad = [
            i
            for i in range(len(r))
            if not identical(name, tuple(t[i : i + 1].cpu() for t in ours), tuple(t[i : i + 1] for t in cpu))
        ]
        ref_bad = sum(
            not identical(name, tuple(t[i : i + 1].cpu() for t in here), tuple(t[i : i + 1] for t in cpu))
            for i in range(len(r))
        )
        print(f"  {name} {label}: {len(bad)} of {len(r)} rows differ from the reference here (first {bad[:8]}), "
              f"{len(cpu_bad)} from the CPU reference; the reference here vs on the CPU: {ref_bad} rows differ")  # fmt: skip


def kernel_vs_reference(layers: dict[int, torch.Tensor], x: torch.Tensor, device: str) -> bool:
    """The encode kernels against the references: GB/s of bf16 in, and byte identity on the same rows."""
    refs = {"fp8_e4m3": fp8.quantize_fp8, "mxfp4": mxfp4.quantize_mxfp4}
    kerns = {"fp8_e4m3": kernels.encode_fp8, "mxfp4": kernels.encode_mxfp4}
    if not kernels.available(x):
        print("\nno encode kernel here (a CUDA device and Triton needed): the reference encodes only")
        return True
    tokens, hidden = x.shape
    gb = x.numel() * 2 / 1e9
    print(f"\n# encode kernel vs reference, {tokens:,} tokens x hidden {hidden} (bf16 in), mean of 20, best of 3")
    print("| format | kernel GB/s of bf16 in | reference GB/s | kernel / reference | kernel ms per M tokens | byte identity |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    ok = True
    for name in ("mxfp4", "fp8_e4m3"):
        try:
            tk = timed_loop(kerns[name], x, device=device)
        except Exception as e:  # noqa: BLE001 - the printout says why, and the other format still runs
            print(f"| {name} | kernel did not run: {type(e).__name__}: {str(e)[:300]} | | | | FAIL |")
            print(f"byte identity {name} kernel vs reference, hidden {hidden}: FAIL (the kernel did not run)")
            ok = False
            continue
        tr = timed_loop(refs[name], x, device=device, loops=3)
        rows = [*layers.values(), planted_rows(hidden, device)]
        same = all(identical(name, kerns[name](r), refs[name](r)) for r in rows)
        ok &= same
        n = sum(len(r) for r in rows)
        verdict = f"{'PASS' if same else 'FAIL'} ({n:,} rows: {len(layers)} layers + 16 planted)"
        print(f"| {name} | {gb / tk:,.0f} | {gb / tr:,.0f} | {tr / tk:.1f}x | {tk / tokens * 1e9:.1f} | {verdict} |")
        print(f"byte identity {name} kernel vs reference, hidden {hidden}: {verdict}")
        if not same:
            where(name, kerns[name], refs[name], {**{f"layer {k}": v for k, v in layers.items()}, "planted": rows[-1]})
    tiles(x, device)
    return ok


def tiles(x: torch.Tensor, device: str) -> None:
    """The MXFP4 kernel's GB/s at other tiles (rows x columns a program, warps) beside kernels.py's, for tuning."""
    saved, gb, cells = (kernels.MX_ROWS, kernels.MX_COLS, kernels.MX_WARPS), x.numel() * 2 / 1e9, []
    for tile in (saved, (1, 1024, 4), (2, 2048, 8), (8, 512, 4), (16, 256, 4), (1, 4096, 8)):
        kernels.MX_ROWS, kernels.MX_COLS, kernels.MX_WARPS = tile
        try:
            rate = gb / timed_loop(kernels.encode_mxfp4, x, device=device)
            same = all(map(torch.equal, kernels.encode_mxfp4(x[:4099]), mxfp4.quantize_mxfp4(x[:4099])))
            cells.append(f"{tile[0]}x{tile[1]}/{tile[2]}w {rate:,.0f}{'' if same else ' (bytes DIFFER)'}")
        except Exception as e:  # noqa: BLE001 - a tile this Triton cannot build: said, the others still run
            cells.append(f"{tile[0]}x{tile[1]}/{tile[2]}w {type(e).__name__}")
    kernels.MX_ROWS, kernels.MX_COLS, kernels.MX_WARPS = saved
    print(f"mxfp4 kernel GB/s by tile (rows x columns / warps; the first is kernels.py's): {'; '.join(cells)}")


def states_of_shard(shard: Path, max_tokens: int) -> tuple[dict[int, torch.Tensor], str]:
    m, n = read_manifest(shard), min(read_manifest(shard).tokens, max_tokens)
    out = {lid: LayerReader(shard / f"layer_{lid}.safetensors").rows(0, n) for lid in m.layer_ids}  # fmt: skip
    return out, f"{shard} (hidden {m.hidden_size}, ids {m.layer_ids})"


def states_of_shape(shape: str, device: str, tokens: int, seed: int) -> tuple[dict[int, torch.Tensor], str]:
    """A random Llama of the shape's hidden size, 4 layers, on `tokens` random token ids: ids 1..4 (4 = N)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, heads = {"llama-8b": (4096, 14336, 32), "kimi": (7168, 18432, 64)}[shape]
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=8,
                      num_hidden_layers=4, vocab_size=32000, max_position_embeddings=8192)  # fmt: skip
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: Kimi's width in fp32 would need twice the memory
    with torch.device(device):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    ids = torch.randint(0, 32000, (tokens // 2048, 2048), device=device)
    with torch.inference_mode():
        hs = model(ids, output_hidden_states=True).hidden_states
    return {i: hs[i].reshape(-1, hidden) for i in range(1, 5)}, f"random Llama, hidden {hidden} ({shape})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shard", type=Path)
    ap.add_argument("--shape", choices=["llama-8b", "kimi"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=8192, help="of the shard, or of random rows (--shape)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--encode-tokens", type=int, default=65536, help="rows the encodes are timed on (the last "
                    "layer's, repeated)")  # fmt: skip
    args = ap.parse_args()
    if not (args.shard or args.shape):
        sys.exit("--shard or --shape")
    made = states_of_shard(args.shard, args.tokens) if args.shard else states_of_shape(args.shape, args.device, args.tokens, args.seed)  # fmt: skip
    layers, what = {lid: x.to(args.device, torch.bfloat16) for lid, x in made[0].items()}, made[1]
    ids = sorted(layers)
    last, (tokens, hidden) = ids[-1], layers[ids[-1]].shape
    print(f"# storage formats on {what}: {tokens:,} tokens, layers {ids}, {args.device}")
    bf16_bytes = len(ids) * 2 * hidden + TOKEN_ID_BYTES

    fp8, mx = formats.storage_format("fp8_e4m3"), formats.storage_format("mxfp4")
    per_layer = {  # name -> (roundtrip of one layer given its id, bytes per token of that layer)
        "bf16 (model_dtype)": (lambda lid, x: x.float(), lambda lid: 2 * hidden),
        "fp8_e4m3": (lambda lid, x: fp8.roundtrip(x), lambda lid: fp8.token_bytes(hidden, "bfloat16")),
        "mxfp4": (lambda lid, x: mx.roundtrip(x), lambda lid: mx.token_bytes(hidden, "bfloat16")),
        "nvfp4-style (e4m3 / 16 + f32 / token)": (lambda lid, x: nvfp4_roundtrip(x), lambda lid: hidden // 2 + hidden // 16 + 4),
        "int4, one scale a token": (lambda lid, x: int4_token_roundtrip(x), lambda lid: hidden // 2 + 4),
        "mxfp4, last layer fp8_e4m3": (
            lambda lid, x: fp8.roundtrip(x) if lid == last else mx.roundtrip(x),
            lambda lid: (fp8 if lid == last else mx).token_bytes(hidden, "bfloat16"),
        ),
    }  # fmt: skip
    print(
        "\n| format | bytes / token (4 layers + ids) | of bf16 | zstd'd, of bf16 | error per layer: mean / p99 / worst |"
    )
    print("|---|---|---|---|---|")  # fmt: skip
    for name, (roundtrip, nbytes) in per_layer.items():
        total = sum(nbytes(lid) for lid in ids) + TOKEN_ID_BYTES
        errs = []
        for lid in ids:
            x = layers[lid].float()
            e = (x - roundtrip(lid, x)).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)
            errs.append(f"{lid}: {e.mean():.4f} / {e.quantile(0.99):.4f} / {e.max():.4f}")
        ratios = [zstd_ratio(name, layers[lid]) for lid in ids] if name in ("fp8_e4m3", "mxfp4") else [None]
        z_total = (
            None if None in ratios else sum(r * nbytes(i) for r, i in zip(ratios, ids, strict=True)) + TOKEN_ID_BYTES
        )
        z = f"{z_total / bf16_bytes:.3f} ({z_total:,.0f} B)" if z_total else ""
        print(f"| {name} | {total:,} | {total / bf16_bytes:.3f} | {z} | {'; '.join(errs)} |")
    topk = (len(ids) - 1) * mx.token_bytes(hidden, "bfloat16") + TOPK * 6 + TOKEN_ID_BYTES
    print(f"| mxfp4, last layer as top-{TOPK} probabilities | {topk:,} | {topk / bf16_bytes:.3f} | | n/a (no state) |")

    big = layers[last].repeat(-(-args.encode_tokens // tokens), 1)[: args.encode_tokens]
    ok = kernel_vs_reference(layers, big, args.device)
    x = layers[last]
    print(f"\n# cost of one layer's {tokens:,} tokens (hidden {hidden}), the capture's encode; best of 3")
    for name in ("fp8_e4m3", "mxfp4"):
        fmt = formats.storage_format(name)
        enc = timed(fmt.encode, x, device=args.device)
        parts = fmt.encode(x)
        dec = timed(fmt.decode, parts, torch.bfloat16, device=args.device)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one loader worker
        dec_cpu = timed(fmt.decode, tuple(p.cpu() for p in parts), torch.bfloat16, device="cpu")
        torch.set_num_threads(threads)
        mtok = tokens / 1e6
        print(
            f"{name}: encode on {args.device} {enc / mtok * 1e3:.1f} ms per M tokens ({x.numel() * 2 / enc / 1e9:.0f} GB/s "
            f"of bf16 in); decode on {args.device} {dec / mtok * 1e3:.1f} ms per M tokens; decode on one CPU thread "
            f"{dec_cpu / mtok:.2f} s per M tokens ({tokens * hidden / dec_cpu / 1e6:.0f} M values/s)"
        )
    if not ok:
        sys.exit("byte identity FAIL: the kernel and the reference encode differ on the same rows")


if __name__ == "__main__":
    main()
