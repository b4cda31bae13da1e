"""Print every figure docs/evidence.md quotes on draft quality from one quality-bench run folder (OUT of run.py).

    python bench/quality/summarize.py OUT [LATER_RUN ...]    # docs/runs/acceptance/summary.txt

Later runs (device_more.sh: the same target rebuilt bit-identically) add cells to the first run's table:
each section is printed per run, and the table pools every (variant, seed) of all runs.

The target (target.json), the workflow stages (summary.json, the regenerate counts, the validation), each
draft's training (first and last loss, the trainer's validation of its first and last epoch: full_acc per
position and 1 + their sum), and each served engine (serve/*.json: acceptance, per position, tok/s, decode
wall, and how many greedy outputs equal the target's alone).

With --drafts (run.py), a table per draft type: each variant's seeds, its mean and spread, and a verdict line of
each of ours' variants against the peer: ours >= peer within seed noise, the noise the larger seed spread of the
two. The figure is vLLM's mean acceptance length where vLLM served the type, else speculators' own validation
metric of the last epoch (SPECULATORS_METRICS).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path


def _text(path: Path) -> str:
    """A file of the run folder, or its .gz (a run folder may hold large logs compressed)."""
    gz = path.with_name(path.name + ".gz")
    return path.read_text() if path.exists() else gzip.decompress(gz.read_bytes()).decode()


def _glob(folder: Path, pattern: str) -> list[Path]:
    """Files matching pattern, plain or gzipped, by their plain name."""
    names = {p.with_name(p.name.removesuffix(".gz")) for p in folder.glob(pattern + "*")}
    return sorted(p for p in names if p.match(pattern))


def _val_epochs(metrics: Path) -> list[tuple[int, list[float]]]:
    out = []
    for line in _text(metrics).splitlines():
        r = json.loads(line)
        if "val" in r:
            accs = [r["val"][f"full_acc_{i}_epoch"] for i in range(3) if f"full_acc_{i}_epoch" in r["val"]]
            out.append((r["epoch"], accs))
    return out


def main(runs: list[Path]) -> None:
    first = runs[0]
    alone = first / "serve/target_only.json"  # none on a run that served nothing (the toy run on the CPU)
    target_out = json.loads(_text(alone))["outputs"] if _glob(alone.parent, alone.name) else None
    cells, summaries = {}, []
    for run in runs:
        print(f"# run {run}")
        summaries.append(json.loads((run / "summary.json").read_text()))
        sections(run, summaries[-1], target_out)
        for res in _glob(run / "serve", "*_s[0-9].json"):
            if res.name.startswith("speed_"):
                continue
            variant, seed = re.fullmatch(r"(.+)_s(\d+)", res.stem).groups()
            if int(seed) in cells.get(variant, {}):
                raise SystemExit(f"error: {variant} seed {seed} served in two runs ({res})")
            cells.setdefault(variant, {})[int(seed)] = json.loads(_text(res))
    table(cells, summaries, runs)
    by_type = draft_cells(runs)
    for kind, variants in by_type.items():
        drafts_table(kind, variants)
    trained = {json.loads(r.read_text()).get("type") for run in runs for r in (run / "drafts").glob("*/recipe.json")}
    for kind in sorted(trained - set(by_type) - {None}):
        print(f"\n{kind}: no draft of this type trained (its train lines above say why)")


def sections(run: Path, summary: dict, target_out: list) -> None:
    """The target, the workflow stages, each draft's training and each served engine of one run folder."""
    t = json.loads((run / "target/target.json").read_text())
    print(
        f"target: {t['parameters']:,} parameters, {t['wall_s']} s, loss {t['loss_first_last']}, "
        f"held-out loss {t['heldout_loss']}, top-1 {t['heldout_top1']} ({t['tokens']} tokens), "
        f"modules {t['modules']}, conversations {t['conversations']}, weights {t['sha256']['weights']}"
    )
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
        if _glob(val.parent, val.name):
            v = json.loads(_text(val))
            print(f"  validation: ok {v['ok']}, {v['rows']} rows, {v['tokens']} tokens, {v['reference_floor']}")
    for name, d in summary.get("train", {}).items():
        print(f"train {name}: rc {d['rc']}, {d['wall_s']} s, loss {d['loss_first_last']} {d.get('error', '')}")
    for metrics in _glob(run / "drafts", "*/metrics.jsonl"):
        epochs, own = _val_epochs(metrics), speculators_metric(metrics)
        if own and not own[1].endswith("full_acc_i"):  # a type without eagle3's per-step accuracies
            print(f"  {metrics.parent.name} val last epoch: {own[1]} {own[0]:.4f}")
            continue
        for epoch, accs in (epochs[0], epochs[-1]) if epochs else ():
            print(
                f"  {metrics.parent.name} val epoch {epoch}: full_acc {[round(a, 3) for a in accs]}, "
                f"1 + sum {1 + sum(accs):.2f}"
            )
    # A later run serves no target alone: the first run's outputs (same weights, same prompts) stand in.
    for res in _glob(run / "serve", "*.json"):
        if res.name == "prompts.json":
            continue
        s = json.loads(_text(res))
        if "outputs" not in s:
            continue
        same = sum(a == b for a, b in zip(s["outputs"], target_out, strict=True)) if target_out else None
        print(
            f"serve {res.stem}: draft {s['draft']}, mean acceptance length {s.get('mean_acceptance_length')}, "
            f"per position {s.get('acceptance_per_position')}, {s['output_tokens_per_s']} tok/s "
            f"({s['output_tokens']} tokens in {s['wall_s']} s), engine start {s['engine_start_s']} s, "
            f"outputs equal to the target's alone {same}/{len(target_out or ())}"
        )
    if (run / "vllm_serves.json").exists():  # run.py's serve stage asked the installed vLLM
        print(f"vLLM loads speculators' {json.loads((run / 'vllm_serves.json').read_text())['types']}")
    peer = summary.get("peer", {}).get("peer", {})
    if "validation" in peer:
        print(f"peer validation (validate_shard, every row): {peer['validation']}")


def verdict(summaries: list[dict], variant: str) -> str:
    """The workflow's validation verdicts on a variant's data in every run that made it (planted and peer:
    validate_shard on every row)."""
    found = []
    for summary in summaries:
        if variant in summary.get("plant", {}):
            found.append(summary["plant"][variant]["validation"].split(":")[0])
        elif variant in summary.get("data", {}):
            found.append("/".join(sorted(set(summary["data"][variant]["verdict"].values()))) or "none")
        elif variant == "peer" and isinstance(summary.get("peer", {}).get("peer", {}).get("validation"), dict):
            found.append("/".join(sorted({v.split(":")[0] for v in summary["peer"]["peer"]["validation"].values()})))
    return ", ".join(found) or "not run"


def table(serve: dict, summaries: list[dict], folders: list[Path]) -> None:
    """Each variant's acceptance per seed, the noise band (the largest gap between two seeds of one
    variant) and each variant's distance from ours in bands; then tokens/s on an idle GPU."""
    if len(serve.get("ours", {})) < 2:
        return  # no band without two seeds of ours
    mean = {v: sum(r["mean_acceptance_length"] for r in runs.values()) / len(runs) for v, runs in serve.items()}
    spreads = {
        v: max(r["mean_acceptance_length"] for r in runs.values())
        - min(r["mean_acceptance_length"] for r in runs.values())
        for v, runs in serve.items()
        if len(runs) > 1
    }
    # Issue #23: the spread of ours' seeds is the band every comparison uses; a variant's own spread is
    # printed beside it, since a wider one says its distance from ours is less certain.
    band = spreads["ours"]
    print(
        f"\nnoise band {band:.4f} (the spread of ours' {len(serve['ours'])} seeds); largest spread of any variant "
        f"{max(spreads.values()):.4f} ({max(spreads, key=spreads.get)}); spreads "
        + ", ".join(f"{v} {x:.4f}" for v, x in spreads.items())
    )
    print("variant | seeds: mean acceptance length | mean | vs ours (bands) | per position (mean) | validation")
    for v, runs in serve.items():
        per_pos = [sum(r["acceptance_per_position"][i] for r in runs.values()) / len(runs) for i in range(3)]
        delta = mean[v] - mean["ours"]
        print(
            f"{v} | "
            + " ".join(f"s{s} {r['mean_acceptance_length']:.4f}" for s, r in sorted(runs.items()))
            + f" | {mean[v]:.4f} | {delta:+.4f} ({delta / band:+.1f}) | {[round(x, 3) for x in per_pos]} | "
            + verdict(summaries, v)
        )
    alone, ours = (folders[0] / "serve/speed_target_only.json"), (folders[0] / "serve/speed_ours_s0.json")
    if _glob(alone.parent, alone.name) and _glob(ours.parent, ours.name):
        a, o = json.loads(_text(alone)), json.loads(_text(ours))
        print(
            f"idle GPU, {a['prompts']} prompts at once: target alone {a['output_tokens_per_s']} tok/s, with ours_s0 "
            f"{o['output_tokens_per_s']} tok/s ({o['output_tokens_per_s'] / a['output_tokens_per_s']:.2f}x), "
            f"acceptance length {o['mean_acceptance_length']}"
        )


# speculators' validation metric of each type (the val record's `<key>_epoch`), the first the record holds; for
# each its label and whether higher is better. eagle3's 1 + sum of its per-step full accuracies is the acceptance
# length a chain of those accuracies gives; dflash logs an expected acceptance length (eal), dspark accept_len.
SPECULATORS_METRICS = (
    ("eal", "speculators val eal", True),
    ("accept_len", "speculators val accept_len", True),
    ("full_acc_0", "speculators val 1 + sum full_acc_i", True),
    ("full_acc", "speculators val full_acc", True),
    ("loss", "speculators val loss", False),
)


def speculators_metric(metrics: Path) -> tuple[float, str, bool] | None:
    """The last epoch's validation figure of a draft (SPECULATORS_METRICS), its label and direction."""
    vals = [json.loads(line)["val"] for line in _text(metrics).splitlines() if '"val"' in line]
    for key, label, higher in SPECULATORS_METRICS if vals else ():
        if f"{key}_epoch" in vals[-1]:
            last = vals[-1]
            accs = [v for k, v in sorted(last.items()) if re.fullmatch(r"full_acc_\d+_epoch", k)]
            return (1 + sum(accs) if key == "full_acc_0" else last[f"{key}_epoch"]), label, higher
    return None


def draft_cells(runs: list[Path]) -> dict[str, dict[str, dict[int, dict]]]:
    """{type: {variant: {seed: {"vllm": acceptance length or None, "own": speculators_metric}}}} of the drafts
    run.py --drafts trained (their recipe.json names the type)."""
    cells: dict = {}
    for run in runs:
        for recipe in sorted((run / "drafts").glob("*/recipe.json")):
            r, save = json.loads(recipe.read_text()), recipe.parent
            own = speculators_metric(save / "metrics.jsonl") if _glob(save, "metrics.jsonl") else None
            if "type" not in r or own is None:
                continue  # before --drafts (the table above), or a draft that did not train
            served = run / "serve" / f"{save.name}.json"
            acc = (
                json.loads(_text(served)).get("mean_acceptance_length") if _glob(served.parent, served.name) else None
            )
            cells.setdefault(r["type"], {}).setdefault(r["variant"], {})[r["seed"]] = {"vllm": acc, "own": own}
    return cells


def drafts_table(kind: str, variants: dict[str, dict[int, dict]]) -> None:
    """One draft type: variant x seed, mean and spread, then each other variant against the peer. vLLM's mean
    acceptance length where every cell was served, else speculators' metric for every cell: one figure a table."""
    served = all(c["vllm"] is not None for runs in variants.values() for c in runs.values())
    first = next(iter(next(iter(variants.values())).values()))  # every cell of a type has the same metric
    label, higher = ("vLLM mean acceptance length", True) if served else first["own"][1:]
    figure = {
        v: {seed: c["vllm"] if served else c["own"][0] for seed, c in runs.items()} for v, runs in variants.items()
    }
    print(f"\n{kind} ({label}, {'higher' if higher else 'lower'} is better)\nvariant | seeds | mean | spread")
    stats = {}
    for v, runs in sorted(figure.items()):
        xs = [x for _, x in sorted(runs.items())]
        stats[v] = (sum(xs) / len(xs), max(xs) - min(xs), len(xs))
        print(f"{v} | " + " ".join(f"s{seed} {x:.4f}" for seed, x in sorted(runs.items()))
              + f" | {stats[v][0]:.4f} | {stats[v][1]:.4f}")  # fmt: skip
    if "peer" not in stats:
        print(f"{kind}: no verdict (no peer cells)")
    for v in [v for v in stats if v != "peer" and "peer" in stats]:
        (mine, spread, n), (peer, peer_spread, m) = stats[v], stats["peer"]
        noise = max(spread, peer_spread)
        gap = (mine - peer) if higher else (peer - mine)  # > 0: ours better
        few = "" if min(n, m) > 1 else " (one seed: no spread, noise 0)"
        print(f"{kind} {v} >= peer within seed noise: {'yes' if gap >= -noise else 'NO'} "
              f"(gap {gap:+.4f}, noise {noise:.4f}){few}")  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+", help="run.py's OUT, then later runs that add cells")
    main(ap.parse_args().runs)
