"""Disk per billion captured tokens for each storage format (docs/guides/storage.md's table), computed from the
formats' own byte counts (shard/formats.py: what `plan`, the free-space check and the writer use), with the
acceptance length each format's drafts reached beside it where a committed printout measured it.

    python bench/storage_disk.py [--acceptance docs/runs/acceptance/summary.txt]

Shapes: the hidden sizes of an 8B, a 70B and a 405B Llama and of Kimi-K2.5, four layer ids (the default), bf16
capture, token ids (8 B a token) included. Acceptance: each run block (`# run <dir>`) of the summary, the mean
acceptance length of its drafts per variant (`ours` = model_dtype, `fp8` = fp8_e4m3, `mxfp4` = mxfp4), each seed
listed; a format with no such line says so (nothing is carried over from elsewhere).
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

from eagle3prep.shard import formats

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"Llama 8B": 4096, "Llama 70B": 8192, "Kimi-K2.5": 7168, "Llama 405B": 16384}
LAYERS, TOKEN_ID_BYTES, BILLION = 4, 8, 10**9
VARIANT = {"ours": formats.MODEL_DTYPE, "fp8": formats.FP8_E4M3, "mxfp4": formats.MXFP4}


def bytes_per_token(storage: str, hidden: int) -> int:
    return LAYERS * formats.storage_format(storage).token_bytes(hidden, "bfloat16") + TOKEN_ID_BYTES


def acceptance(path: Path) -> dict[str, list[tuple[str, list[float]]]]:
    """{storage: [(run, [mean acceptance length of each seed's draft])]} from the summary's serve lines."""
    out: dict[str, list[tuple[str, list[float]]]] = {}
    run, found = "", {}
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    for line in [*lines, "# run end"]:
        if line.startswith("# run "):
            for storage, values in found.items():
                out.setdefault(storage, []).append((run, values))
            run, found = line.removeprefix("# run ").strip(), {}
        elif m := re.match(r"serve (ours|fp8|mxfp4)_s\d+: .*mean acceptance length ([\d.]+)", line):
            found.setdefault(VARIANT[m.group(1)], []).append(float(m.group(2)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--acceptance", type=Path, default=REPO / "docs/runs/acceptance/summary.txt")
    args = ap.parse_args()
    measured = acceptance(args.acceptance)
    print(f"# disk per billion tokens: {LAYERS} layer ids, bf16 capture, token ids included (TB = 10^12 bytes)")
    print("\n| storage | " + " | ".join(f"{name} (H {h:,})" for name, h in SHAPES.items()) + " | of bf16 |")
    print("|---|" + "---|" * (len(SHAPES) + 1))
    base = bytes_per_token(formats.MODEL_DTYPE, 4096)
    for storage in formats.STORAGES:
        cells = [f"{bytes_per_token(storage, h) * BILLION / 1e12:.1f} TB" for h in SHAPES.values()]
        print(f"| {storage} | " + " | ".join(cells) + f" | {bytes_per_token(storage, 4096) / base:.1%} (H 4,096) |")
    rel = args.acceptance.relative_to(REPO) if args.acceptance.is_relative_to(REPO) else args.acceptance
    print(f"\n# mean acceptance length of the drafts trained on each format's rows ({rel})")
    for storage in formats.STORAGES:
        runs = measured.get(storage)
        if not runs:
            print(f"{storage}: not measured in this printout")
            continue
        for run, values in runs:
            seeds = " / ".join(f"{v:.3f}" for v in values)
            print(f"{storage}: {statistics.mean(values):.3f} (seeds {seeds}; run {run})")


if __name__ == "__main__":
    main()
