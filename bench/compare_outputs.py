"""Are two runs' hidden-state shards the same bytes? `python bench/compare_outputs.py RESULTS_A RESULTS_B`

Compares every shard folder under A/hidden_states with B's: each data file (layer files, token ids,
index.json) byte for byte, and manifest.json with `code_version` left out (it names the source
tree, which is what changed). timings.json holds wall-clock facts and is skipped. Prints one line per
file and exits 1 on any difference: the evidence that a refactor changed nothing for a user.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import sys
from pathlib import Path


def compare(a: Path, b: Path) -> list[str]:
    lines = []
    for shard in sorted((a / "hidden_states").glob("shard_*")):
        other = b / "hidden_states" / shard.name
        names = sorted({p.name for p in shard.iterdir()} | {p.name for p in other.iterdir()} if other.is_dir() else [])
        for name in names:
            if name in ("timings.json", ".snakemake_timestamp"):
                continue
            pa, pb = shard / name, other / name
            if not (pa.is_file() and pb.is_file()):
                lines.append(f"DIFF {shard.name}/{name}: missing on one side")
            elif name == "manifest.json":
                ma, mb = (json.loads(p.read_text()) for p in (pa, pb))
                ma.pop("code_version", None), mb.pop("code_version", None)
                keys = sorted(k for k in ma.keys() | mb.keys() if ma.get(k) != mb.get(k))
                lines.append(
                    f"{'same' if not keys else 'DIFF'} {shard.name}/{name} (without code_version){f': {keys}' if keys else ''}"
                )
            else:
                same = filecmp.cmp(pa, pb, shallow=False)
                lines.append(f"{'same' if same else 'DIFF'} {shard.name}/{name} ({pa.stat().st_size} bytes)")
    return lines


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path, help="RESULTS_A: a run's results/ folder")
    ap.add_argument("b", type=Path, help="RESULTS_B: the other run's")
    args = ap.parse_args()
    out = compare(args.a, args.b)
    print("\n".join(out) or "no shard folders found")
    sys.exit(1 if not out or any(line.startswith("DIFF") for line in out) else 0)
