"""The gate's training: the export of its shard, then speculators' trainer through `eagle3prep-train`.

It runs in a child process (`python -m eagle3prep.overfit_gate.train JOB.json`): the trainer needs speculators,
hs_connectors and datasets, which a vLLM environment may lack (then `EAGLE3PREP_TRAIN_PYTHON` names a
Python that has them, e.g. the base .venv), and a fresh process leaves nothing of the first engine in
the trainer's memory. Overfitting on purpose: every step is one batch holding every gate row, for many
steps at speculators' default learning rate, the checkpoint written once, at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

TRAIN_PYTHON_ENV = "EAGLE3PREP_TRAIN_PYTHON"
NEEDS = ("speculators", "hs_connectors", "datasets")
MAX_DRAFT_VOCAB = 32768  # speculators' default draft vocabulary; a small target's whole vocabulary


def train_python() -> tuple[str | None, str]:
    """(the Python that trains, how it was chosen) or (None, why none can)."""
    chosen = os.environ.get(TRAIN_PYTHON_ENV)
    python = chosen or sys.executable
    code = "import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in sys.argv[1:]) else 1)"
    found = bool(shutil.which(python) or Path(python).is_file())
    if found and subprocess.run([python, "-c", code, *NEEDS], capture_output=True).returncode == 0:
        return python, f"{TRAIN_PYTHON_ENV}={chosen}" if chosen else "this job's Python"
    where = f"{TRAIN_PYTHON_ENV}={chosen}" if chosen else f"this job's Python ({sys.executable})"
    return None, (
        f"{where} lacks {'/'.join(NEEDS)} (pip install --no-deps -r envs/speculators.txt, or set "
        f"{TRAIN_PYTHON_ENV} to a Python that has them)"
    )


def ratio_for(train_rows: int) -> float:
    """speculators' --train-data-ratio that puts the first `train_rows` rows in the training split and the
    last one (rows.training_rows' copy) in the validation split: int(n * ratio) = train_rows exactly
    (the half keeps float rounding off the boundary)."""
    return (train_rows + 0.5) / (train_rows + 1)


def epochs_for(export: str, steps: int, seq_len: int, ratio: float, nproc: int = 1, seed: int = 0) -> int:
    """Epochs that hold `steps` optimizer steps, counted by speculators' own batch sampler on the training
    split (tests/testkit/train_both.py and bench/quality count them here too): with more epochs than that, speculators starts one more
    step in every epoch after --max-steps."""
    from datasets import load_from_disk
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    lengths = list(load_from_disk(str(export)).with_format(None)["seq_len"])
    lengths = lengths[: int(len(lengths) * ratio)]
    sampler = MultipackDistributedBatchSamplerV2(seq_len, lengths, num_replicas=nproc, rank=0, seed=seed)
    total, epoch = 0, 0
    while total < steps:
        sampler.set_epoch(epoch)
        total += len(sampler)
        epoch += 1
    return epoch


def trainer_argv(job: dict[str, Any]) -> list[str]:
    """`eagle3prep-train` arguments: ours, `--`, speculators'."""
    steps, save = int(job["steps"]), Path(job["out"])
    ours = ["--metrics-jsonl", str(save / "metrics.jsonl"), "--deterministic"]
    if job.get("cpu"):
        ours.append("--cpu")
    theirs = [
        *("--verifier-name-or-path", job["model"], "--data-path", job["export"], "--speculator-type", "eagle3"),
        *("--target-layer-ids", *map(str, job["layer_ids"])),
        *("--hidden-states-backend", "eagle3prep", "--on-missing", "raise"),
        *("--draft-vocab-size", str(job["draft_vocab_size"]), "--total-seq-len", str(job["total_seq_len"])),
        *("--train-data-ratio", str(ratio_for(job["train_rows"]))),
        # The epochs that hold `steps` (epochs_for); the checkpoint once, after the last.
        *("--epochs", str(job["epochs"]), "--max-steps", str(steps), "--checkpoint-freq", str(job["epochs"])),
        *("--seed", "0", "--num-workers", "0", "--lr", str(job["lr"]), "--loss-fn", job.get("loss_fn", "ce")),
        *("--loss-implementation", "eager", "--draft-attn-impl", "sdpa"),
        *("--save-path", str(save / "checkpoints"), "--log-dir", str(save / "logs")),
    ]
    return [*ours, "--", *theirs]


def run(job: dict[str, Any], python: str, log_path: Path, timeout: float | None = None) -> dict[str, Any]:
    """Train in a child process; the summary of its metrics (losses, accuracies) and the draft's folder."""
    out = Path(job["out"])
    shutil.rmtree(out, ignore_errors=True)  # a killed earlier gate must not resume from its checkpoint
    out.mkdir(parents=True)
    (out / "job.json").write_text(json.dumps(job, indent=1))
    src = str(Path(__file__).resolve().parents[2])  # the package, also for a Python without it installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.run(
            [python, "-m", "eagle3prep.overfit_gate.train", str(out / "job.json")],
            env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
        )  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"the gate's training failed (exit {proc.returncode}); its output is in {log_path}")
    return summary(out)


def summary(out: Path) -> dict[str, Any]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r["train"] for r in records if "train" in r]
    val = [r["val"] for r in records if "val" in r]
    accs = sorted(k for k in train[-1] if k.startswith("full_acc_"))
    return {
        "steps": len(train),
        "loss_first": train[0]["loss"],
        "loss_last": train[-1]["loss"],
        "val_loss_last": val[-1]["loss_epoch"] if val else None,
        # speculators' own training accuracy per drafted position (TTT step), on the last batch.
        "train_full_acc_last": [train[-1][k] for k in accs],
        "losses": [round(t["loss"], 5) for t in train],
        "draft": str(final_checkpoint(out)),
    }


def final_checkpoint(out: Path) -> Path:
    epochs = [p for p in (out / "checkpoints").iterdir() if p.name.isdigit() and (p / "config.json").is_file()]
    if not epochs:
        raise RuntimeError(f"the gate's training wrote no checkpoint under {out / 'checkpoints'}")
    return max(epochs, key=lambda p: int(p.name))


def main(argv: list[str] | None = None) -> int:
    """The child: export the gate's shard (direct), then speculators' trainer through eagle3prep-train."""
    job = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    from ..export import export_speculators
    from ..train.cli import main as eagle3prep_train

    export_speculators(
        shard_dirs=[job["shard"]], validations=[job["validation"]], tokenized=[job["tokenized"]],
        token_freq_json=job["token_freq"], out_dir=job["export"], hidden_states="direct",
    )  # fmt: skip
    # The draft's aux ids as the export names them (the captured ids without N, speculators' order):
    # the run's own ids, whatever a planted mistake put in the layer files.
    job["layer_ids"] = json.loads((Path(job["export"]) / "manifest.json").read_text())["target_layer_ids"]
    job["epochs"] = epochs_for(job["export"], int(job["steps"]), job["total_seq_len"], ratio_for(job["train_rows"]))
    return eagle3prep_train(trainer_argv(job))


if __name__ == "__main__":
    sys.exit(main())
