"""HiddenStatesDataset: speculators' per-row items straight from our shard folders, equal to the export's."""

from __future__ import annotations

import pickle

import pytest
import torch
from safetensors.torch import load_file
from test_export import AUX, BF16_READ_MAX, FINAL, H, all_rows, finished_results, layer_rows, rel_per_token

from eagle3prep.export.dataset import HiddenStatesDataset

KEYS = ["hidden_states", "input_ids", "verifier_last_hidden_states", "loss_mask", "lengths", "position_ids"]


@pytest.fixture(scope="module")
def results(tmp_path_factory, demo_model_dir):
    return finished_results(tmp_path_factory, demo_model_dir)


def from_export(results, i: int) -> dict[str, torch.Tensor]:
    """Row i of the export, assembled the way speculators' ArrowDataset._get_raw_data + __getitem__ do."""
    hs = load_file(results / f"export/speculators/hidden_states/hs_{i}.safetensors")  # [T, L, H], token_ids [T]
    r = all_rows(results)[i]
    T = len(r["input_ids"])
    return {
        "hidden_states": hs["hidden_states"][:, :-1].flatten(1),  # [T, (L-1)*H]
        "input_ids": hs["token_ids"],
        "verifier_last_hidden_states": hs["hidden_states"][:, -1],  # [T, H]
        "loss_mask": torch.tensor(r["loss_mask"], dtype=torch.int64),
        "lengths": torch.tensor([T], dtype=torch.long),
        "position_ids": torch.arange(T, dtype=torch.long),
    }


def assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b) == KEYS
    for k in KEYS:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def test_items_equal_the_export_without_copying_it(results):
    ds = HiddenStatesDataset.from_results(results)
    rows = all_rows(results)
    assert len(ds) == len(rows) and ds.approx_lengths == [r["seq_len"] for r in rows]
    assert ds.layer_ids[:-1] == AUX and ds.hidden_states_dtype == torch.bfloat16
    for i in range(len(ds)):
        item = ds[i]
        assert item["hidden_states"].shape == (rows[i]["seq_len"], 3 * H)
        assert_same(item, from_export(results, i))


def test_matches_speculators_arrow_dataset(results):
    data = pytest.importorskip("speculators.train.data", reason="speculators 0.9.0: make .venv/.installed")
    theirs = data.ArrowDataset(max_len=256, datapath=str(results / "export/speculators"), on_missing="raise")
    ours = HiddenStatesDataset.from_results(results)
    assert ours.approx_lengths == theirs.approx_lengths
    for i in range(len(ours)):
        assert_same(ours[i], theirs[i])
    val = HiddenStatesDataset.from_results(results, train_ratio=0.6, split="val")
    theirs_val = data.ArrowDataset(
        max_len=256, datapath=str(results / "export/speculators"), on_missing="raise", train_ratio=0.6, split="val"
    )
    assert len(val) == len(theirs_val) == 2
    assert_same(val[1], theirs_val[1])


def test_pickles_for_spawned_workers_and_splits_like_speculators(results):
    ds = HiddenStatesDataset.from_results(results)
    ds[0]  # opens file handles, which must not travel to a worker
    again = pickle.loads(pickle.dumps(ds))
    assert_same(again[4], ds[4])
    train = HiddenStatesDataset.from_results(results, train_ratio=0.6)
    val = HiddenStatesDataset.from_results(results, train_ratio=0.6, split="val")
    assert (len(train), len(val)) == (3, 2)  # int(5 * 0.6) rows for training, as ArrowDataset splits
    assert_same(val[0], ds[3])


def test_refuses_a_tokenized_shard_it_was_not_captured_from(results):
    shards = [results / "hidden_states/shard_0", results / "hidden_states/shard_1"]
    swapped = [results / "tokenized/shard_1.jsonl", results / "tokenized/shard_0.jsonl"]
    with pytest.raises(ValueError, match="not the tokenized shard"):
        HiddenStatesDataset(shards, swapped)
    with pytest.raises(ValueError, match="out of order"):
        HiddenStatesDataset(shards[::-1], swapped)


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator")  # CPU here
def test_speculators_dataloader_gives_the_same_batches(results):
    """speculators' own DataLoader (batch sampler, collate, EAGLE-3 shift) over ours and over the export."""
    data = pytest.importorskip("speculators.train.data", reason="speculators 0.9.0: make .venv/.installed")
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import _setup_dataloader

    def batches(ds):
        loader = _setup_dataloader(
            ds, 64, H, num_workers=0, num_target_layers=3, prefetch_factor=None, preprocess=shift_batch
        )
        return [{k: v for k, v in b.items() if isinstance(v, torch.Tensor)} for b in loader]

    theirs = data.ArrowDataset(max_len=64, datapath=str(results / "export/speculators"), on_missing="raise")
    ours, want = batches(HiddenStatesDataset.from_results(results)), batches(theirs)
    assert len(ours) == len(want) > 1
    for a, b in zip(ours, want, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fp8_shards_read_dequantized_to_bf16(tmp_path_factory, demo_model_dir):
    """FP8 shards: items in bf16, the shard's values dequantized (shard.readers.read_layer); close to what
    speculators' fp8 backend reads from the FP8 export (the same FP8 values, dequantized in bf16 there)."""
    data = pytest.importorskip("speculators.train.data", reason="speculators 0.9.0: make .venv/.installed")
    import argparse

    from hs_connectors.transfer import FP8Backend

    res = finished_results(tmp_path_factory, demo_model_dir, "fp8_e4m3")
    ours = HiddenStatesDataset.from_results(res)
    out = res / "export/speculators"
    transfer = FP8Backend.from_train_args(argparse.Namespace(hidden_states_path=None), str(out))
    theirs = data.ArrowDataset(max_len=256, datapath=str(out), on_missing="raise", transfer=transfer)
    aux = [layer_rows(res, i, torch.bfloat16) for i in AUX]
    final = layer_rows(res, FINAL, torch.bfloat16)
    for i in range(len(ours)):
        item, want = ours[i], theirs[i]
        assert list(item) == KEYS and item["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(item["hidden_states"], torch.cat([a[i] for a in aux], dim=-1))
        assert torch.equal(item["verifier_last_hidden_states"], final[i])
        for k in ("input_ids", "loss_mask", "lengths", "position_ids"):
            assert torch.equal(item[k], want[k]), k
        assert rel_per_token(item["verifier_last_hidden_states"], want["verifier_last_hidden_states"]) < BF16_READ_MAX
        assert rel_per_token(item["hidden_states"][:, :H], want["hidden_states"][:, :H]) < BF16_READ_MAX


def test_from_results_reads_the_datasets_shards_not_a_folder_another_config_left(results, tmp_path):
    # Before: every shard_* folder was read, and a leftover without its tokenized shard stopped the load.
    import json
    import shutil

    copy = shutil.copytree(results, tmp_path / "results")
    stats = {"shards": [{"shard": k, "rows": 1, "tokens": 1} for k in (0, 1)]}
    (copy / "tokenized" / "stats.json").write_text(json.dumps(stats))
    shutil.copytree(copy / "hidden_states" / "shard_0", copy / "hidden_states" / "shard_2")
    ds = HiddenStatesDataset.from_results(copy)
    assert len(ds) == len(HiddenStatesDataset.from_results(results))
    assert [d.name for d in ds.shard_dirs] == ["shard_0", "shard_1"]
