"""Training without the export copy (issue #14 items 3, 4): speculators' own trainer on the demo data, once
from a copy export (hs files, speculators' `file` backend) and once from a direct export (no hs files, our
`eagle3prep` backend reading the shard folders); the losses must be identical."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from speculators_cpu import run_trainer_on_cpu
from test_export import export_inputs, finished_results
from workflow_helpers import REPO

from eagle3prep.export import export_speculators

pytest.importorskip("speculators.train.cli", reason="speculators 0.9.0: make .venv/.installed")

from eagle3prep.train.backend import BACKEND, Eagle3PrepBackend, ShardTransfer  # noqa: E402
from eagle3prep.train.cli import main as train_main  # noqa: E402
from eagle3prep.train.rows import ExportRows, ExportRowsError  # noqa: E402

STEPS = 6


def demo_exports(workdir: Path, out: Path) -> dict[str, Path]:
    """Both exports of a workflow run's results/, as its export rule makes them: {"copy": dir, "direct": dir}."""
    k = range(len(list((workdir / "results/hidden_states").glob("shard_*"))))
    inputs = {
        "shard_dirs": [f"results/hidden_states/shard_{i}" for i in k],
        "validations": [f"results/validation/shard_{i}.json" for i in k],
        "tokenized": [f"results/tokenized/shard_{i}.jsonl" for i in k],
        "token_freq_json": "results/tokenized/token_freq.json",
    }
    with contextlib.chdir(workdir):  # the validations name their shards relative to the workflow's folder
        for mode in ("copy", "direct"):
            export_speculators(**inputs, out_dir=str(out / mode), hidden_states=mode)
    return {mode: out / mode for mode in ("copy", "direct")}


@pytest.fixture(scope="module")
def demo(small_demo_run, tmp_path_factory) -> dict:
    """The demo workflow's results (3 shards, 181 rows, bf16), exported both ways into a scratch folder."""
    exports = demo_exports(small_demo_run, tmp_path_factory.mktemp("train_exports"))
    return {"model": small_demo_run / "results/demo/model", "exports": exports}


def train(monkeypatch, tmp: Path, model: Path, export: Path, backend: str, name: str) -> list[dict]:
    """speculators' trainer (eagle3, eager loss, sdpa attention, a 1-layer draft) for STEPS steps on the CPU,
    through `eagle3prep-train`; returns its metrics records (train steps, then the validation epoch)."""
    run_trainer_on_cpu(monkeypatch)
    target = json.loads((export / "manifest.json").read_text())["target_layer_ids"]
    metrics = tmp / f"{name}.jsonl"
    args = [
        *("--verifier-name-or-path", str(model), "--data-path", str(export)),
        *("--speculator-type", "eagle3", "--target-layer-ids", *map(str, target)),
        *("--hidden-states-backend", backend, "--on-missing", "raise"),
        *("--draft-vocab-size", "64", "--total-seq-len", "128", "--num-workers", "0"),
        *("--loss-implementation", "eager", "--draft-attn-impl", "sdpa"),
        *("--epochs", "1", "--max-steps", str(STEPS), "--seed", "0", "--train-data-ratio", "0.97"),
        *("--save-path", str(tmp / f"{name}-ckpt"), "--log-dir", str(tmp / f"{name}-logs")),
    ]
    assert train_main(["--metrics-jsonl", str(metrics), "--", *args]) == 0
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def losses(records: list[dict]) -> tuple[list[float], dict]:
    steps = [r["train"]["loss"] for r in records if "train" in r]
    (val,) = [r["val"] for r in records if "val" in r]
    return steps, val


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator")
def test_direct_training_has_identical_losses_to_the_copy(demo, monkeypatch, tmp_path):
    copy, direct = demo["exports"]["copy"], demo["exports"]["direct"]
    runs = {
        "copy": train(monkeypatch, tmp_path, demo["model"], copy, "file", "copy"),
        "direct": train(monkeypatch, tmp_path, demo["model"], direct, BACKEND, "direct"),
    }
    (copy_steps, copy_val), (direct_steps, direct_val) = losses(runs["copy"]), losses(runs["direct"])
    print(f"bf16 train losses {copy_steps}; validation {copy_val['loss_epoch']}")
    assert len(copy_steps) == STEPS and all(math.isfinite(x) and x > 0 for x in copy_steps)
    assert direct_steps == copy_steps  # identical floats: the same bytes went in
    assert direct_val == copy_val and math.isfinite(copy_val["loss_epoch"])
    # The draft checkpoint speculators saved after the run is the same too.
    a, b = (load_file(tmp_path / f"{n}-ckpt/0/model.safetensors") for n in ("copy", "direct"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_direct_export_holds_no_hidden_state_byte_and_serves_the_same_rows(demo):
    copy, direct = demo["exports"]["copy"], demo["exports"]["direct"]
    on_disk = sorted(str(p.relative_to(direct)) for p in direct.rglob("*") if p.is_file())
    manifest = json.loads((direct / "manifest.json").read_text())
    assert manifest["hidden_states"] == "direct" and not (direct / "hidden_states").exists()
    assert not [p for p in on_disk if p.endswith(".safetensors")]
    assert on_disk == sorted([*manifest["files"], "manifest.json"])
    hs_bytes = sum(p.stat().st_size for p in (copy / "hidden_states").iterdir())
    direct_bytes = sum((direct / p).stat().st_size for p in on_disk)
    assert direct_bytes < hs_bytes / 20  # the arrow part and token_freq.pt only

    rows = manifest["rows"]
    transfer = Eagle3PrepBackend.from_train_args(_Args(), str(direct))
    assert isinstance(transfer, ShardTransfer)
    for i in range(rows):
        got, want = transfer.get_cached(i), load_file(copy / f"hidden_states/hs_{i}.safetensors")
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (i, k)
    assert transfer.get_cached(rows) is None  # past the end: speculators' on_missing policy decides
    with pytest.raises(RuntimeError, match="generates none"):
        transfer.get_generated({"handle": "x"})


class _Args:
    """The namespace speculators hands a backend's from_train_args (our flag left at its default)."""

    eagle3prep_shards = None


@pytest.fixture(scope="module")
def small(tmp_path_factory, demo_model_dir) -> Path:
    return finished_results(tmp_path_factory, demo_model_dir)


def test_rows_follow_moved_shards_and_refuse_changed_ones(small, tmp_path):
    inputs = export_inputs(small)
    export_speculators(**inputs, out_dir=str(tmp_path / "direct"), hidden_states="direct")
    want = ExportRows.from_export(tmp_path / "direct").get(4)

    moved = tmp_path / "elsewhere"
    for d in inputs["shard_dirs"]:
        shutil.copytree(d, moved / Path(d).name)
    rows = ExportRows.from_export(tmp_path / "direct", shards_dir=moved)
    assert all(torch.equal(rows.get(4)[k], want[k]) for k in want)

    # A shard extracted again after the export: its rows may no longer match the arrow part.
    manifest = moved / "shard_1/manifest.json"
    manifest.write_text(manifest.read_text().replace('"rows"', '"rows" ', 1))
    with pytest.raises(ExportRowsError, match="changed since the export"):
        ExportRows.from_export(tmp_path / "direct", shards_dir=moved).get(4)
    shutil.rmtree(moved / "shard_0")
    with pytest.raises(ExportRowsError, match="shard folder .*shard_0 .* is missing"):
        ExportRows.from_export(tmp_path / "direct", shards_dir=moved)
    with pytest.raises(ExportRowsError, match="must be an eagle3prep export"):
        ExportRows.from_export(tmp_path)


def test_console_script_registers_the_backend_for_speculators_parser():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["eagle3prep-train"] == "eagle3prep.train.cli:main"
    # A fresh process, as a user runs it: speculators' own --help lists our backend and its flag.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-m", "eagle3prep.train", "--", "--help"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--eagle3prep-shards" in out.stdout and "eagle3prep" in out.stdout.split("--hidden-states-backend")[1]
