"""Ratios over a bench's repeated rounds (bench/bench_extract.py --rounds): one engine's rate moves 6-16 % from run
to run on the H200, so each capture phase is set against its own round's plain prefill ((a) eager; the compiled
phases (f) and (g) also against (p), compiled) and read as the median and range over rounds."""

from __future__ import annotations

import statistics


def round_ratios(rounds: list[dict]) -> list[str]:
    """--rounds: each capture phase's ratio to its own round's (a), and (f) and (g)'s to its (p), per workload and
    round, then the median and range over rounds (a /dev/shm uniform shard against the baseline's uniform rate)."""
    lines = []
    for x, a in (("b", "a"), ("f", "a"), ("g", "a"), ("f", "p"), ("g", "p")):
        for w in ("uniform", "mixed", "uniform_shm"):
            base = "uniform" if w == "uniform_shm" else w
            ratios = [
                r[x][w]["tokens_per_s"] / r[a][base]["tokens_per_s"] for r in rounds if x in r and a in r and w in r[x]
            ]
            if ratios:
                each = " ".join(f"{v:.2f}" for v in ratios)
                lines.append(
                    f"{x}/{a} {w}: rounds {each}; median {statistics.median(ratios):.2f}, "
                    f"{min(ratios):.2f}-{max(ratios):.2f}"
                )
    return lines
