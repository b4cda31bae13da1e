"""The host side of the hooks capture path alone: how close shard.sink.LayerSink gets to the disk.

No GPU and no vLLM: synthetic forward steps (the 8B shape by default: 4 layers x 4096 x bf16, steps
of 16,384 tokens, rows of 2,048 tokens, first-come first-served chunks) go through LayerSink into
OUTDIR, and the same number of bytes is then written by plain threads, one file per layer with
a background fdatasync as the worker's (bench/extractbench/disk.py, disk_write_speed): the baseline, in the same run.

    python bench/bench_sink.py OUTDIR [--gib 4]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from extractbench.disk import disk_write_speed  # noqa: E402

from eagle3prep.shard.files import FLUSH_EVERY  # noqa: E402
from eagle3prep.shard.sink import LayerSink, Segment, SinkSpec  # noqa: E402


def run_sink(args, out: Path, sync_bytes: int) -> dict:
    """One shard through LayerSink; seconds in all and in finish() (the tail: last writes, final fsync)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    per_token = args.layers * args.hidden * 2  # bf16
    rows = max(1, int(args.gib * 2**30 / per_token / args.row_tokens))
    total = rows * args.row_tokens
    step = [torch.randn(args.step_tokens, args.hidden).to(torch.bfloat16) for _ in range(args.layers)]
    paths = {lid: str(out / f"layer_{lid}.safetensors") for lid in range(args.layers)}

    t0 = time.perf_counter()
    placement = [(i * args.row_tokens, args.row_tokens) for i in range(rows)]
    spec = SinkSpec(
        paths,
        args.hidden,
        "bfloat16",
        placement,
        step_tokens=args.step_tokens,
        sync_bytes=sync_bytes,
        slots=3,
        tag_prefix="row",
    )
    sink = LayerSink(spec)
    for first in range(0, total, args.step_tokens):  # FCFS: a step is the next step_tokens tokens
        if args.pace_gbs:  # a GPU's pace: the step's rows are not there before the forward made them
            due = t0 + first * per_token / (args.pace_gbs * 1e9)
            time.sleep(max(0.0, due - time.perf_counter()))
        segments, start, pos = [], 0, first
        while pos < min(first + args.step_tokens, total):
            row, at = divmod(pos, args.row_tokens)
            n = min(args.row_tokens - at, first + args.step_tokens - pos, total - pos)
            segments.append(Segment(spec.tag(row), at, start, start + n))
            start, pos = start + n, pos + n
        sink.begin_step(segments)
        for lid in range(args.layers):
            sink.add_layer(lid, step[lid][:start])
    t1 = time.perf_counter()
    sink.finish()
    t2 = time.perf_counter()
    shutil.rmtree(out)
    return {"tokens": total, "bytes": total * per_token, "secs": t2 - t0, "tail_s": t2 - t1, "stats": sink.stats()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--gib", type=float, default=4.0, help="bytes of hidden states to write")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--step-tokens", type=int, default=16384)
    ap.add_argument("--row-tokens", type=int, default=2048)
    ap.add_argument(
        "--sync-mib", type=int, nargs="+", default=[FLUSH_EVERY >> 20], help="background flush every N MiB per file"
    )
    ap.add_argument(
        "--pace-gbs", type=float, default=0.0, help="hand steps over at this rate, as a GPU would (0: at once)"
    )
    args = ap.parse_args()

    runs = {mib: run_sink(args, args.out / "sink", mib << 20) for mib in args.sync_mib}
    nbytes = next(iter(runs.values()))["bytes"]
    disk = disk_write_speed(args.out, nbytes, streams=args.layers)

    first = next(iter(runs.values()))
    print(
        f"# {time.strftime('%Y-%m-%d')} {torch.__version__}, {args.layers} layers x {args.hidden} bf16, "
        f"{first['tokens']:,} tokens ({nbytes / 1e9:.2f} GB), steps of {args.step_tokens:,} tokens, "
        + (f"paced at {args.pace_gbs} GB/s" if args.pace_gbs else "unpaced")
    )
    for mib, r in runs.items():
        print(
            f"LayerSink, flush every {mib} MiB (copy to slots, write, hash, flush, fsync): "
            f"{nbytes / r['secs'] / 1e9:.2f} GB/s in {r['secs']:.2f} s, of which finish() {r['tail_s']:.2f} s; "
            f"timings (s): {r['stats']}"
        )
    print(
        f"the disk, {args.layers} files at once with a background fdatasync every {FLUSH_EVERY >> 20} MiB: "
        f"{disk / 1e9:.2f} GB/s"
    )
    for mib, r in runs.items():
        print(f"LayerSink every {mib} MiB / disk: {nbytes / r['secs'] / disk:.2f}")


if __name__ == "__main__":
    main()
