"""Print every figure docs/quality.md quotes from one quality-bench run folder (OUT of run.py).

    python bench/quality/summarize.py docs/runs/quality/h200_2026-12-01

The target (target.json), the workflow stages (summary.json, the regenerate counts, the validation), each
draft's training (first and last loss, the trainer's validation of its first and last epoch: full_acc per
position and 1 + their sum), and each served engine (serve/*.json: acceptance, per position, tok/s, decode
wall, and how many greedy outputs equal the target's alone).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _val_epochs(metrics: Path) -> list[tuple[int, list[float]]]:
    out = []
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if "val" in r:
            accs = [r["val"][f"full_acc_{i}_epoch"] for i in range(3) if f"full_acc_{i}_epoch" in r["val"]]
            out.append((r["epoch"], accs))
    return out


def main(run: Path) -> None:
    t = json.loads((run / "target/target.json").read_text())
    print(
        f"target: {t['parameters']:,} parameters, {t['wall_s']} s, loss {t['loss_first_last']}, "
        f"held-out loss {t['heldout_loss']}, top-1 {t['heldout_top1']} ({t['tokens']} tokens), "
        f"modules {t['modules']}, conversations {t['conversations']}, weights {t['sha256']['weights']}"
    )
    summary = json.loads((run / "summary.json").read_text())
    for name, d in summary.get("data", {}).items():
        print(f"data {name}: rc {d['rc']}, {d['wall_s']} s, verdicts {d['verdict']}")
        counts = run / "wd" / name / "results/regenerated/counts.json"
        if counts.exists():
            rep = json.loads(counts.read_text())["files"][0]["replies"]
            print(
                f"  regenerate: {rep['requests']} replies, {rep['output_tokens']} output tokens, stop {rep['stop']}, "
                f"length {rep['length']}, retokenized differently {rep['retokenized_differently']}"
            )
        val = run / "wd" / name / "results/validation/shard_0.json"
        if val.exists():
            v = json.loads(val.read_text())
            print(f"  validation: ok {v['ok']}, {v['rows']} rows, {v['tokens']} tokens, {v['reference_floor']}")
    for name, d in summary.get("train", {}).items():
        print(f"train {name}: rc {d['rc']}, {d['wall_s']} s, loss {d['loss_first_last']}")
    for metrics in sorted((run / "drafts").glob("*/metrics.jsonl")):
        epochs = _val_epochs(metrics)
        for epoch, accs in (epochs[0], epochs[-1]) if epochs else ():
            print(
                f"  {metrics.parent.name} val epoch {epoch}: full_acc {[round(a, 3) for a in accs]}, "
                f"1 + sum {1 + sum(accs):.2f}"
            )
    target_out = json.loads((run / "serve/target_only.json").read_text())["outputs"]
    for res in sorted((run / "serve").glob("*.json")):
        if res.name == "prompts.json":
            continue
        s = json.loads(res.read_text())
        same = sum(a == b for a, b in zip(s["outputs"], target_out, strict=True))
        print(
            f"serve {res.stem}: draft {s['draft']}, mean acceptance length {s.get('mean_acceptance_length')}, "
            f"per position {s.get('acceptance_per_position')}, {s['output_tokens_per_s']} tok/s "
            f"({s['output_tokens']} tokens in {s['wall_s']} s), engine start {s['engine_start_s']} s, "
            f"outputs equal to the target's alone {same}/{len(target_out)}"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
