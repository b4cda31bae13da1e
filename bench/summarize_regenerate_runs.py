"""Figures derived from committed bench_regenerate.py outputs (docs/runs/regenerate/), printed so the docs
quote them.

    python bench/summarize_regenerate_runs.py docs/runs/regenerate/h200*/bench_regenerate.json

Per run: b/a of the mean tok/s (what the bench prints) and of the total time over all rounds; the stage's own
work outside engine.step() (seconds and share of its round) and the b/a it alone allows (engine-step time over
total time: b/a if (b)'s engine steps took as long as (a)); in how many rounds the phase run second was the
faster one (runs before 2026-12-01 record no order: they ran (a) first); and the GPU-hours per million output
tokens at (b)'s mean rate.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def summarize(path: Path) -> None:
    run = json.loads(path.read_text())
    rounds = run["rounds"]
    a = statistics.mean(r["a_tokens_per_s"] for r in rounds)
    b = statistics.mean(r["b_tokens_per_s"] for r in rounds)
    a_time = sum(r["a_s"] for r in rounds)
    b_time = sum(r["b_s"] for r in rounds)
    own = [r["b_s"] - r["b_engine_step_s"] for r in rounds]
    share = [o / r["b_s"] for o, r in zip(own, rounds, strict=True)]
    alone = [r["b_engine_step_s"] / r["b_s"] for r in rounds]
    second_faster = sum((r["b_tokens_per_s"] > r["a_tokens_per_s"]) == (r.get("first", "a") == "a") for r in rounds)
    print(f"{path.parent.name}: {len(rounds)} rounds, engine start {run['engine_start_s']:.1f} s")
    print(
        f"  mean tok/s (a) {a:,.0f}, (b) {b:,.0f}; b/a of the means {b / a:.3f}, of the total time {a_time / b_time:.3f}"
    )
    per_round = ", ".join(f"{r['b_over_a']:.3f}" for r in rounds)
    print(f"  per-round b/a: {per_round}")
    print(
        f"  (b) own work {min(own):.2f}-{max(own):.2f} s, {100 * min(share):.1f}-{100 * max(share):.1f} % of its "
        f"round; b/a it alone allows >= {min(alone):.3f}"
    )
    order = "alternated" if any("first" in r for r in rounds) else "(a) first in every round"
    print(f"  order {order}: the phase run second was faster in {second_faster} of {len(rounds)} rounds")
    print(f"  GPU-hours per million output tokens at (b)'s mean rate: {1e6 / b / 3600:.4f}")


def main() -> None:
    for arg in sys.argv[1:]:
        summarize(Path(arg))


if __name__ == "__main__":
    main()
