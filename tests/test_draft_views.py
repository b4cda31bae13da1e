"""One capture, every draft: the dataset captured once at the union of its drafts' layers (testkit.drafts_data), one
view per draft with no copy (exactly the layers speculators' trainer reads for that draft, in its order, from the
same shards, opening only their files), and speculators' own trainer training every draft type it ships from it
through `eagle3prep-train --cpu`, the loss falling."""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("speculators.train.cli", reason="speculators 0.9.0: make .venv/.installed")

from eagle3prep.drafts import trainer_args  # noqa: E402
from eagle3prep.layers import default_layer_ids  # noqa: E402
from eagle3prep.train import rows as rows_module  # noqa: E402
from eagle3prep.train.backend import draft_view  # noqa: E402
from eagle3prep.train.rows import ExportRows, ExportRowsError  # noqa: E402

from testkit import drafts_data  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """The drafts' dataset on the tiny Qwen3 target with an MTP head (testkit.drafts_data)."""
    return drafts_data.build(tmp_path_factory.mktemp("drafts"))


def test_the_union_is_captured_once_and_each_draft_reads_its_own_layers(data):
    by_name = {d.name: d for d in data["drafts"]}
    n = drafts_data.N
    assert by_name["eagle3"].reads == by_name["peagle"].reads == default_layer_ids(n)  # [2, 3, 6]: N//2 = N-3
    assert by_name["dflash"].reads == [1, 3, 5, n]  # published ids [0, 2, 4] are the outputs of those layers
    assert by_name["mtp"].reads == [n]
    assert data["layer_ids"] == sorted(set().union(*(d.reads for d in data["drafts"])))
    for shard in data["shards"]:
        assert json.loads((shard / "manifest.json").read_text())["layer_ids"] == data["layer_ids"]


def test_a_view_is_the_drafts_layers_in_its_order_from_the_same_bytes(data):
    rows = ExportRows.from_export(data["export"])
    full = rows.get(3)["hidden_states"]  # [T, L, H], every captured layer
    slot = {lid: k for k, lid in enumerate(data["layer_ids"])}
    for view in ([1, 3, 5, drafts_data.N], [5, 1, drafts_data.N], [drafts_data.N]):
        got = rows.with_view(view).get(3)
        assert torch.equal(got["hidden_states"], full[:, [slot[i] for i in view]])  # same bytes, this order
        assert torch.equal(got["token_ids"], rows.get(3)["token_ids"])


def test_reading_a_drafts_view_opens_only_its_layer_files(data, monkeypatch):
    opened: list[str] = []
    real = rows_module.LayerReader

    def spy(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(rows_module, "LayerReader", spy)
    view = [1, 3, 5, drafts_data.N]
    rows = ExportRows.from_export(data["export"]).with_view(view)
    for row in range(len(drafts_data.LENGTHS[0]) + 1):  # rows of both shards
        rows.get(row)
    assert sorted(set(opened)) == sorted(f"layer_{i}.safetensors" for i in view)
    assert len(opened) == 2 * len(view)  # once a shard, each


def test_the_backend_gives_each_draft_type_the_view_its_trainer_reads(data):
    captured, n, model = data["layer_ids"], drafts_data.N, str(data["model"])

    def args(kind, ids=None):
        return argparse.Namespace(speculator_type=kind, target_layer_ids=ids, verifier_name_or_path=model)

    assert draft_view(args("mtp"), captured) == [n]
    assert draft_view(args("dflash", [1, 3, 5]), captured) == [1, 3, 5, n]
    assert draft_view(args("eagle3", [2, 3]), captured) == [2, 3, n]
    # without ids the view is speculators' own default [2, N//2, N-3], which repeats 3 on this 6-layer target: its
    # refusal, the reason every named draft hands the trainer explicit --target-layer-ids (drafts.default_aux)
    with pytest.raises(ValueError, match=r"Default target layer ids \[2, 3, 3\] are invalid"):
        draft_view(args("eagle3"), captured)
    with pytest.raises(ExportRowsError, match=r"layer ids \[4\] of the view \[4, 6\] were not captured"):
        ExportRows.from_export(data["export"]).with_view(draft_view(args("dspark", [4]), captured))


def speculators_args(data: dict, draft, out: Path, epochs: int) -> list[str]:
    """speculators train arguments for one draft from the one export: its type and --target-layer-ids, the
    eagle3prep backend (the view), the CPU's attention and loss (no FlexAttention backward, no Triton on a CPU)."""
    return [
        *("--verifier-name-or-path", str(data["model"]), "--data-path", str(data["export"])),
        *("--hidden-states-backend", "eagle3prep", "--on-missing", "raise"),
        # the type's flags as the quality bench gives them; one draft layer (the block drafts default to 5) and
        # blocks of 4 (default 8 or 16): seconds on one core
        *trainer_args(draft, 64, num_layers=1, block_size=4),
        *("--total-seq-len", "128", "--train-data-ratio", "0.9", "--epochs", str(epochs), "--lr", "3e-3"),
        *("--seed", "0", "--num-workers", "0", "--checkpoint-freq", "100"),
        *("--save-path", str(out / "checkpoints"), "--log-dir", str(out / "logs")),
    ]


K = 3  # steps averaged at each end


@pytest.mark.parametrize("kind", drafts_data.TYPES)
def test_speculators_trains_every_draft_from_the_one_dataset(data, kind, tmp_path):
    from eagle3prep.train.cli import main

    draft = next(d for d in data["drafts"] if d.type == kind)
    metrics = tmp_path / "metrics.jsonl"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "'pin_memory' argument is set as true but no accelerator")
        main(["--cpu", "--deterministic", "--metrics-jsonl", str(metrics), "--",
              *speculators_args(data, draft, tmp_path, drafts_data.EPOCHS)])  # fmt: skip
    losses = [json.loads(line)["train"]["loss"] for line in metrics.read_text().splitlines() if '"train"' in line]
    assert len(losses) >= 2 * K and all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-K:]) / K < sum(losses[:K]) / K, losses


@pytest.mark.integration
def test_the_workflow_captures_the_drafts_union_once_and_a_served_draft_redoes_nothing(tmp_path):
    """The demo workflow with drafts named: every shard holds the union, the export serves each draft's view, and
    naming one more draft whose layers are held (mtp) leaves every extract job done."""
    import copy

    import yaml

    from testkit.workflow import SMALL_CONFIG, make_workdir, snakemake

    config = copy.deepcopy(SMALL_CONFIG)
    config["tokenize"]["num_shards"] = 2
    config["export"] = {"speculators": True, "hidden_states": "direct"}
    config["layers"] = {
        "drafts": [{"type": "eagle3"}, {"type": "dflash", "ids": [0, 3, 6], "convention": "output_of_layer"}]
    }
    wd = make_workdir(tmp_path / "wd", config)
    run = snakemake(wd, "results/export/speculators")
    assert "captured once for all drafts: the union [1, 2, 4, 5, 7, 8]" in run.stderr
    for k in range(2):
        assert json.loads((wd / f"results/hidden_states/shard_{k}/manifest.json").read_text())["layer_ids"] == [
            1,
            2,
            4,
            5,
            7,
            8,
        ]
    rows = ExportRows.from_export(wd / "results/export/speculators", wd / "results/hidden_states")
    full = rows.get(0)["hidden_states"]
    assert torch.equal(rows.with_view([1, 4, 7, 8]).get(0)["hidden_states"], full[:, [0, 2, 4, 5]])

    config["layers"]["drafts"].append({"type": "mtp"})
    (wd / "config/config.yaml").write_text(yaml.safe_dump(config))
    dry = snakemake(wd, "-n", "results/export/speculators")
    assert "rule extract" not in dry.stdout + dry.stderr, dry.stdout[-2000:]
    # a draft whose layers are not held: refused at parse time; with replace_results every shard is captured again
    config["layers"]["drafts"].append({"type": "dspark", "ids": [3]})
    (wd / "config/config.yaml").write_text(yaml.safe_dump(config))
    refused = snakemake(wd, "-n", "results/export/speculators", check=False)
    assert refused.returncode != 0 and "draft dspark reads layer ids [3] that the finished shards" in refused.stderr
    (wd / "config/config.yaml").write_text(yaml.safe_dump({**config, "replace_results": True}))
    again = snakemake(wd, "-n", "results/export/speculators")
    assert "rule extract" in again.stdout + again.stderr


def test_the_backend_refuses_to_configure_a_vllm_connector_in_one_line():
    """speculators asks a backend for its connector config when it would launch vLLM; ours captured already."""
    import argparse

    from eagle3prep.train.backend import Eagle3PrepBackend

    assert "build_kv_transfer_config" in vars(Eagle3PrepBackend)
    with pytest.raises(ValueError, match="no vLLM connector to configure"):
        Eagle3PrepBackend.build_kv_transfer_config(argparse.Namespace())
