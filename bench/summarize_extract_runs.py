"""Figures derived from committed bench_extract.py outputs (docs/runs/), printed so the docs quote them.

    python bench/summarize_extract_runs.py docs/runs/bench_extract_2026-11-30_*.txt

Per run: b/a (and f/a, g/a: the built-in path) to disk and to /dev/shm, what writing to disk costs (b) per shard (the disk run minus
the /dev/shm run, tokens / rate), (d)'s share of (a) and the b/d that (b) would reach at (a)'s rate,
and the disk's own speeds measured before and after the phases. Then the shard size `snakemake plan`
recommends from the Llama example's `plan` numbers.

    python bench/summarize_extract_runs.py --against BASE.log RUN.log

Two runs of the same workloads on different code (no phase in common is needed): each phase's rate per workload
in RUN, and RUN / BASE, the change between runs, which is not a same-run ratio.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from extractbench.disk import disk_cost  # noqa: E402
from extractbench.report import round_ratios  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DISK = re.compile(r"before / after the phases: ([\d.]+) / ([\d.]+) GB/s one file, ([\d.]+) / ([\d.]+) GB/s")


def summarize(path: Path) -> None:
    text = path.read_text()
    phases = phases_of(path)
    a, b, d = phases.get("a"), phases.get("b"), phases.get("d")
    print(f"{path.name}:")
    # the capture phases: hooks, built-in, built-in FP8; n: (b) again (an A/A pair, docs/evidence.md)
    for x in ("b", "f", "g", "n"):
        if a and phases.get(x):
            for w in ("uniform", "mixed"):
                print(f"  {x}/a {w}: {phases[x][w]['tokens_per_s'] / a[w]['tokens_per_s']:.2f}")
            if "uniform_shm" in phases[x]:
                shm = phases[x]["uniform_shm"]["tokens_per_s"] / a["uniform"]["tokens_per_s"]
                print(f"  {x}/a uniform to /dev/shm: {shm:.2f}")
            if "uniform_again" in phases[x]:  # the uniform shard to disk once more, last (--images runs)
                again = phases[x]["uniform_again"]["tokens_per_s"] / a["uniform"]["tokens_per_s"]
                print(f"  {x}/a uniform to disk again, last: {again:.2f}")
                if "uniform_again" in a:  # (a) ran the uniform rows once more, last, too (since 2026-12-03)
                    last = phases[x]["uniform_again"]["tokens_per_s"] / a["uniform_again"]["tokens_per_s"]
                    print(f"  {x}/a uniform, both last: {last:.2f}")
    if a and "uniform_again" in a:
        print(
            f"  (a) uniform again / uniform: {a['uniform_again']['tokens_per_s'] / a['uniform']['tokens_per_s']:.2f}"
        )
    if b and "uniform_shm" in b:
        print(f"  (b) uniform {disk_cost(b)}")
    if a and d:
        share = d["uniform"]["tokens_per_s"] / a["uniform"]["tokens_per_s"]
        print(f"  (d) = {share:.2f} x (a) (uniform): b/d is at most {1 / share:.2f} at (a)'s rate")
    rounds = rounds_of(path)
    if len(rounds) > 1:  # --rounds: each round against its own (a)
        print(f"  over {len(rounds)} rounds:")
        for line in round_ratios(rounds):
            print(f"    {line}")
    disk = DISK.search(text)
    companion = path.with_suffix(".json")  # runs whose report has no disk line keep the speeds in their json
    if not disk and companion.exists():
        speeds = [round(v / 1e9, 2) for v in json.loads(companion.read_text())["disk_bytes_per_s"]]
        print(f"  disk GB/s before/after (json disk_bytes_per_s, streams 1, 4, 1, 4): {speeds}")
    if disk:
        speeds = [float(x) for x in disk.groups()]
        print(f"  disk GB/s before/after, one file and 4 files: {speeds}; spread {max(speeds) - min(speeds):.2f}")


def phases_of(path: Path) -> dict:
    return {m[1]: json.loads(m[2]) for m in re.finditer(r"^phase (\w): (\{.*\})$", path.read_text(), re.M)}


def rounds_of(path: Path) -> list[dict]:
    """--rounds runs: each round's {phase: result}, round 1 from its `phase X:` lines, later ones from `round N
    phase X:` lines."""
    rounds = [phases_of(path)]
    for m in re.finditer(r"^round (\d+) phase (\w): (\{.*\})$", path.read_text(), re.M):
        while len(rounds) < int(m[1]):
            rounds.append({})
        rounds[int(m[1]) - 1][m[2]] = json.loads(m[3])
    return rounds


def against(base: Path, run: Path) -> None:
    old, new = phases_of(base), phases_of(run)
    print(f"{run} against {base} (tok/s, and run / base):")
    for x in sorted(old.keys() & new.keys()):
        for w in ("uniform", "mixed", "uniform_shm", "uniform_again"):
            if w in old[x] and w in new[x]:
                a, b = old[x][w]["tokens_per_s"], new[x][w]["tokens_per_s"]
                print(f"  ({x}) {w}: {b:,.0f} against {a:,.0f}: {b / a:.2f}")


def main() -> None:
    if sys.argv[1:2] == ["--against"]:
        against(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    for name in sys.argv[1:]:
        summarize(Path(name))
    sys.path.insert(0, str(REPO / "src"))
    from eagle3prep.plan import min_tokens_per_shard

    plan = yaml.safe_load((REPO / "config/examples/llama-3.1-8b.yaml").read_text())["plan"]
    print(
        f"config/examples/llama-3.1-8b.yaml plan ({plan['tokens_per_s']} tok/s, {plan['engine_start_s']} s start): "
        f"shards of >= {min_tokens_per_shard(plan['tokens_per_s'], plan['engine_start_s']):,} tokens"
    )


if __name__ == "__main__":
    main()
