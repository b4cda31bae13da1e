"""Training both ways on the CPU: both exports of a finished workflow run (`copy`: hs files, `direct`: the arrow
part and our backend reading the shards), then speculators' own trainer from each with the same arguments, in
process, patched for the CPU (speculators_cpu). The losses must be identical: tests/test_train.py and
tests/test_export_images.py."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from eagle3prep.export import export_speculators
from eagle3prep.overfit_gate.train import epochs_for

from testkit.speculators_cpu import run_trainer_on_cpu

WAYS = ("copy", "direct")  # export.hidden_states modes


@dataclass(frozen=True)
class Recipe:
    """speculators train arguments shared by both ways: a 1-layer eagle3 draft over the most frequent ids."""

    seq_len: int  # --total-seq-len
    draft_vocab_size: int
    ratio: float  # --train-data-ratio
    num_workers: int = 0
    seed: int = 0


def make_exports(workdir: Path, out: Path) -> dict[str, Path]:
    """Both exports of a workflow run's shards, as its export rule writes them: {"copy": dir, "direct": dir}."""
    k = range(len(list((workdir / "results/hidden_states").glob("shard_*"))))
    inputs = {  # absolute shard folders: the manifests record them, and training starts elsewhere
        "shard_dirs": [str(workdir / f"results/hidden_states/shard_{i}") for i in k],
        "validations": [f"results/validation/shard_{i}.json" for i in k],
        "tokenized": [f"results/tokenized/shard_{i}.jsonl" for i in k],
        "token_freq_json": "results/tokenized/token_freq.json",
    }
    with contextlib.chdir(workdir):  # validations name their shards relative to the workflow's folder
        for mode in WAYS:
            export_speculators(**inputs, out_dir=str(out / mode), hidden_states=mode)
    return {mode: out / mode for mode in WAYS}


def train_args(model: Path, export: Path, save: Path, steps: int, epochs: int, recipe: Recipe) -> list[str]:
    """speculators train arguments for one way; the same for both but the data path and the backend (the one
    the export's manifest names: eagle3prep for direct, fp8 for a copy of FP8 shards, else file)."""
    manifest = json.loads((export / "manifest.json").read_text())
    return [
        *("--verifier-name-or-path", str(model), "--data-path", str(export), "--speculator-type", "eagle3"),
        *("--target-layer-ids", *map(str, manifest["target_layer_ids"])),
        *("--hidden-states-backend", manifest.get("hidden_states_backend", "file"), "--on-missing", "raise"),
        *("--draft-vocab-size", str(recipe.draft_vocab_size), "--total-seq-len", str(recipe.seq_len)),
        *("--train-data-ratio", str(recipe.ratio), "--epochs", str(epochs), "--max-steps", str(steps)),
        *("--seed", str(recipe.seed), "--num-workers", str(recipe.num_workers)),
        *("--loss-implementation", "eager", "--draft-attn-impl", "sdpa"),
        *("--save-path", str(save / "checkpoints"), "--log-dir", str(save / "logs"), "--checkpoint-freq", "1"),
    ]


def read_metrics(path: Path) -> dict:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {
        "losses": [r["train"]["loss"] for r in records if "train" in r],
        "val_losses": [r["val"]["loss_epoch"] for r in records if "val" in r],
    }


def compare(runs: dict[str, dict]) -> dict:
    """The two ways' losses side by side: identical steps, whether all are, the verdict."""
    a, b = runs["copy"]["losses"], runs["direct"]["losses"]
    finite = all(math.isfinite(x) for x in a + b + runs["copy"]["val_losses"] + runs["direct"]["val_losses"])
    return {
        "identical_steps": sum(x == y for x, y in zip(a, b, strict=False)),
        "all_identical": a == b and runs["copy"]["val_losses"] == runs["direct"]["val_losses"],
        "ok": bool(finite and len(a) == len(b) > 0 and a == b),
    }


def cpu_runner() -> Callable[[list[str]], None]:
    """In-process eagle3prep-train with speculators' trainer patched for the CPU."""
    from eagle3prep.train.cli import main

    def run(argv: list[str]) -> None:
        with pytest.MonkeyPatch.context() as mp:
            run_trainer_on_cpu(mp)
            main(argv)

    return run


def train_both(model: Path, exports: dict[str, Path], out: Path, steps: int, recipe: Recipe, runner) -> dict:
    """Train from each export with the same arguments, deterministically; compare() plus per-way losses."""
    epochs = epochs_for(str(exports["direct"]), steps, recipe.seq_len, recipe.ratio, 1, recipe.seed)
    runs = {}
    for way, export in exports.items():
        metrics = out / f"{way}.jsonl"
        metrics.unlink(missing_ok=True)
        args = train_args(model, export, out / way, steps, epochs, recipe)
        runner(["--deterministic", "--metrics-jsonl", str(metrics), "--", *args])
        runs[way] = {**read_metrics(metrics), "epochs": epochs}
    return {**compare(runs), "runs": runs}
