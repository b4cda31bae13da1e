"""The speculators export (DESIGN.md §7): files, checksums and row order, then read by speculators' own loader."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3prep.export import ExportError, check_shards, export_speculators
from eagle3prep.extract import extract_shard
from eagle3prep.infra.atomic import sha256_file
from eagle3prep.settings import ExtractSettings
from eagle3prep.shard.readers import read_layer

from testkit import calls
from testkit.shards import DEMO_LAYER_IDS, demo_spec, with_settings, write_tokenized
from testkit.workflow import snakemake, tree_digest

LENGTHS = [[9, 30, 17], [24, 5]]  # shard 0 holds rows 0..2, shard 1 rows 3..4
H = 128  # the demo model's hidden size
AUX, FINAL = DEMO_LAYER_IDS[:-1], DEMO_LAYER_IDS[-1]  # [2, 4, 5] and N = 8
_BUILT: dict[str, Path] = {}


def export_inputs(res: Path) -> dict[str, object]:
    k = range(len(LENGTHS))
    return {
        "shard_dirs": [str(res / f"hidden_states/shard_{i}") for i in k],
        "validations": [str(res / f"validation/shard_{i}.json") for i in k],
        "tokenized": [str(res / f"tokenized/shard_{i}.jsonl") for i in k],
        "token_freq_json": str(res / "tokenized/token_freq.json"),
    }


def finished_results(tmp_path_factory, model_dir: Path, storage: str = "model_dtype") -> Path:
    """A `results/` folder as a finished run leaves it: two validated shards and the speculators export.

    Built once per session and storage (extract.storage) with the package functions the rules call
    (test_dataset.py and test_fp8.py use it too).
    """
    if storage not in _BUILT:
        res = tmp_path_factory.mktemp(f"finished_{storage}") / "results"
        (res / "tokenized").mkdir(parents=True)
        freq: Counter[int] = Counter()
        first = 0
        for k, lengths in enumerate(LENGTHS):
            tok = write_tokenized(res / f"tokenized/shard_{k}.jsonl", lengths, seed=k, first_row=first)
            shard = res / f"hidden_states/shard_{k}"
            settings = ExtractSettings.defaults(storage=storage, batch_tokens=64)
            extract_shard(str(tok), str(shard), with_settings(demo_spec(model_dir), settings), shard=k)
            calls.validate(shard, tok, res / f"validation/shard_{k}.json", model_dir, reference=False)
            for r in rows_of(tok):
                freq.update(t for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m)
            first += len(lengths)
        (res / "tokenized/token_freq.json").write_text(json.dumps({str(t): c for t, c in sorted(freq.items())}))
        export_speculators(**export_inputs(res), out_dir=str(res / "export/speculators"), hidden_states="copy")
        _BUILT[storage] = res
    return _BUILT[storage]


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def all_rows(res: Path) -> list[dict]:
    return [r for k in range(len(LENGTHS)) for r in rows_of(res / f"tokenized/shard_{k}.jsonl")]


def layer_rows(res: Path, layer_id: int, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Per global row, its [T, H] slice of layer_{id}.safetensors, read straight from our shards
    (as stored; `dtype`: FP8 shards dequantized to it)."""
    out = []
    for k in range(len(LENGTHS)):
        shard = res / f"hidden_states/shard_{k}"
        if dtype is None:
            with safe_open(shard / f"layer_{layer_id}.safetensors", framework="pt") as f:
                hs = f.get_tensor("hidden_states")  # [sum_T, H] bf16
        else:
            hs = read_layer(shard / f"layer_{layer_id}.safetensors", dtype=dtype)
        out += [hs[e["offset"] : e["offset"] + e["length"]] for e in json.loads((shard / "index.json").read_text())]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory, demo_model_dir) -> Path:
    return finished_results(tmp_path_factory, demo_model_dir)


def test_export_files_checksums_and_contents(results):
    out = results / "export/speculators"
    manifest = json.loads((out / "manifest.json").read_text())
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk and not [p for p in on_disk if ".tmp-" in p]
    for name, entry in manifest["files"].items():
        assert sha256_file(out / name) == entry["sha256"] and (out / name).stat().st_size == entry["bytes"], name
    assert manifest["layer_ids"] == DEMO_LAYER_IDS and manifest["target_layer_ids"] == AUX
    assert manifest["layer_id_convention"] == "input_of_layer" and manifest["rows"] == 5
    assert manifest["hidden_states_backend"] == "file"  # was absent (issue #27: "null"): how to read the hs files
    assert not {"image_rows", "images"} & manifest.keys()  # text rows only: the manifest as before issue #28

    from datasets import load_from_disk

    ds = load_from_disk(str(out))
    rows = all_rows(results)
    assert ds.format["type"] == "torch" and len(ds) == len(rows) == 5
    layers = {i: layer_rows(results, i) for i in DEMO_LAYER_IDS}
    for i, r in enumerate(rows):
        assert r["row"] == i  # arrow row i <-> hs_{i}: speculators' naming is our row id
        item = ds[i]
        for key in ("input_ids", "loss_mask"):
            assert item[key].dtype == torch.int64 and item[key].tolist() == r[key]
        assert int(item["seq_len"]) == r["seq_len"]
        hs = load_file(out / f"hidden_states/hs_{i}.safetensors")
        assert set(hs) == {"token_ids", "hidden_states"}
        assert hs["token_ids"].dtype == torch.int64 and hs["token_ids"].tolist() == r["input_ids"]
        assert hs["hidden_states"].dtype == torch.bfloat16 and hs["hidden_states"].shape == (r["seq_len"], 4, H)
        for slot, layer_id in enumerate(DEMO_LAYER_IDS):  # ascending ids, last slot = id N
            assert torch.equal(hs["hidden_states"][:, slot], layers[layer_id][i])

    freq = torch.load(out / "token_freq.pt", weights_only=True)
    want = json.loads((results / "tokenized/token_freq.json").read_text())
    assert freq == {int(t): c for t, c in want.items()} and all(type(t) is int for t in freq)


def test_speculators_training_loader_reads_the_export(results, demo_model_dir):
    data = pytest.importorskip("speculators.train.data", reason="speculators 0.9.0: make .venv/.installed")
    from hs_connectors import FileTransfer
    from speculators.data_generation.offline import check_hidden_states
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    out = results / "export/speculators"
    rows = all_rows(results)
    aux = [layer_rows(results, i) for i in AUX]
    final = layer_rows(results, FINAL)
    ds = data.ArrowDataset(max_len=256, datapath=str(out), on_missing="raise")  # raise: never call vLLM
    assert len(ds) == 5 and ds.approx_lengths == [r["seq_len"] for r in rows]
    items = [ds[i] for i in range(len(ds))]
    for i, (r, item) in enumerate(zip(rows, items, strict=True)):
        T = r["seq_len"]
        assert list(item) == [
            "hidden_states",
            "input_ids",
            "verifier_last_hidden_states",
            "loss_mask",
            "lengths",
            "position_ids",
        ]
        assert item["hidden_states"].dtype == torch.bfloat16 and item["hidden_states"].shape == (T, 3 * H)
        assert torch.equal(item["hidden_states"], torch.cat([a[i] for a in aux], dim=-1))
        assert item["verifier_last_hidden_states"].shape == (T, H) and torch.equal(
            item["verifier_last_hidden_states"], final[i]
        )
        assert item["input_ids"].dtype == torch.int64 and item["input_ids"].tolist() == r["input_ids"]
        assert item["loss_mask"].dtype == torch.int64 and item["loss_mask"].tolist() == r["loss_mask"]
        assert item["lengths"].tolist() == [T] and torch.equal(item["position_ids"], torch.arange(T))
        check_hidden_states(FileTransfer(out / "hidden_states").get_cached(i), r["input_ids"])  # their validator

    # The validation split maps arrow rows 3, 4 to hs_3, hs_4 (ArrowDataset's start_file_idx).
    val = data.ArrowDataset(max_len=256, datapath=str(out), on_missing="raise", train_ratio=0.6, split="val")
    assert len(val) == 2 and torch.equal(val[1]["input_ids"], items[4]["input_ids"])

    # The trainer's collate + EAGLE-3 shift, packing all five rows into one 256-token sequence.
    batch = data.CollateFn(256, H, num_target_layers=3, preprocess=shift_batch)(items)
    assert batch["hidden_states"].shape == (1, 256, 3 * H) and batch["verifier_last_hidden_states"].shape == (
        1,
        256,
        H,
    )
    assert batch["document_ids"][0, : sum(LENGTHS[0] + LENGTHS[1]) - 5].unique().tolist() == [0, 1, 2, 3, 4]
    d2t, t2d = build_vocab_mappings_from_distribution(
        torch.load(out / "token_freq.pt", weights_only=True), draft_vocab_size=64, target_vocab_size=512
    )
    assert d2t.shape == (64,) and int(t2d.sum()) == 64


# ---- FP8 shards (extract.storage: fp8_e4m3): speculators' FP8 format -----------------------------------
# The export holds the shards' own FP8 bytes and per-layer scales; speculators dequantizes them in bf16,
# so what it reads differs from the shard's float32 dequantization by bf16 rounding only (~0.004).
BF16_READ_MAX = 0.01


@pytest.fixture(scope="module")
def fp8_results(tmp_path_factory, demo_model_dir) -> Path:
    return finished_results(tmp_path_factory, demo_model_dir, "fp8_e4m3")


def rel_per_token(a: torch.Tensor, b: torch.Tensor) -> float:
    """The worst token's |a - b| / |b| ([T, H] tensors)."""
    return float(((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1).clamp_min(1e-30)).max())


def test_fp8_export_is_speculators_fp8_layout(fp8_results):
    fp8_utils = pytest.importorskip("hs_connectors.fp8_utils", reason="speculators 0.9.0: make .venv/.installed")
    out = fp8_results / "export/speculators"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["hidden_states_backend"] == "fp8" and manifest["storage"]["scales"]["key"] == fp8_utils.SCALES_KEY
    for name, entry in manifest["files"].items():
        assert sha256_file(out / name) == entry["sha256"], name
    layers = {i: layer_rows(fp8_results, i, torch.float32) for i in DEMO_LAYER_IDS}
    for i, r in enumerate(all_rows(fp8_results)):
        hs = load_file(out / f"hidden_states/hs_{i}.safetensors")
        assert set(hs) == {"token_ids", "hidden_states", fp8_utils.SCALES_KEY}
        T = r["seq_len"]
        assert hs["hidden_states"].dtype == torch.float8_e4m3fn and hs["hidden_states"].shape == (T, 4, H)
        # per-layer scales (their connector writes [T, 1, 1]; their dequantization broadcasts either)
        assert hs[fp8_utils.SCALES_KEY].dtype == torch.float32 and hs[fp8_utils.SCALES_KEY].shape == (T, 4, 1)
        assert hs["token_ids"].tolist() == r["input_ids"]
        # Their own dequantization of these bytes is the shard's rows exactly (ascending ids, last slot N):
        # nothing was rounded a second time.
        got = fp8_utils.dequantize_fp8_tensor(hs["hidden_states"], hs[fp8_utils.SCALES_KEY], torch.float32)
        assert torch.equal(got, torch.stack([layers[lid][i] for lid in DEMO_LAYER_IDS], 1))


def test_speculators_fp8_backend_reads_the_fp8_export(fp8_results):
    data = pytest.importorskip("speculators.train.data", reason="speculators 0.9.0: make .venv/.installed")
    import argparse

    from hs_connectors.transfer import FP8Backend
    from speculators.data_generation.offline import check_hidden_states
    from speculators.models.eagle3.data import shift_batch

    out = fp8_results / "export/speculators"
    # What `speculators train --hidden-states-backend fp8 --data-path <export>` builds.
    transfer = FP8Backend.from_train_args(argparse.Namespace(hidden_states_path=None), str(out))
    ds = data.ArrowDataset(max_len=256, datapath=str(out), on_missing="raise", transfer=transfer)
    rows = all_rows(fp8_results)
    aux = [layer_rows(fp8_results, i, torch.float32) for i in AUX]
    final = layer_rows(fp8_results, FINAL, torch.float32)
    items = [ds[i] for i in range(len(ds))]
    for i, (r, item) in enumerate(zip(rows, items, strict=True)):
        T = r["seq_len"]
        assert item["hidden_states"].dtype == torch.bfloat16 and item["hidden_states"].shape == (T, 3 * H)
        for j, a in enumerate(aux):
            assert rel_per_token(item["hidden_states"][:, j * H : (j + 1) * H], a[i]) < BF16_READ_MAX, (i, j)
        assert rel_per_token(item["verifier_last_hidden_states"], final[i]) < BF16_READ_MAX, i
        assert item["input_ids"].tolist() == r["input_ids"] and item["loss_mask"].tolist() == r["loss_mask"]
        check_hidden_states(transfer.get_cached(i), r["input_ids"])  # their validator, on the dequantized sample
    batch = data.CollateFn(256, H, num_target_layers=3, preprocess=shift_batch)(items)
    assert batch["hidden_states"].shape == (1, 256, 3 * H) and batch["hidden_states"].dtype == torch.bfloat16


def test_refuses_what_speculators_cannot_train_on(results, tmp_path):
    inputs = export_inputs(results)
    dirs, validations, tokenized = inputs["shard_dirs"], inputs["validations"], inputs["tokenized"]
    with pytest.raises(ExportError, match="expected rows from 0"):
        check_shards(dirs[::-1], validations[::-1], tokenized[::-1])
    failed = tmp_path / "failed.json"
    failed.write_text(json.dumps({"ok": False, "shard_dir": dirs[1]}))
    with pytest.raises(ExportError, match="not a passed validation"):
        check_shards(dirs, [validations[0], str(failed)], tokenized)
    # Layer ids without the pre-norm final state N: speculators would take layer 5 for the verifier's.
    no_final = shutil.copytree(dirs[0], tmp_path / "shard_0")
    manifest = json.loads(Path(dirs[0], "manifest.json").read_text())
    (no_final / "manifest.json").write_text(json.dumps({**manifest, "layer_ids": AUX}))
    (tmp_path / "v.json").write_text(json.dumps({"ok": True, "shard_dir": str(no_final)}))
    with pytest.raises(ExportError, match=r"pre-norm final state \(id 8\)"):
        check_shards([str(no_final)], [str(tmp_path / "v.json")], tokenized[:1])


def test_rerun_over_a_killed_export_ends_byte_identical(results, tmp_path):
    out = shutil.copytree(results / "export/speculators", tmp_path / "speculators")
    # What a kill mid-export leaves: temp files, a partial staging folder, a trainer's vocab cache.
    (out / ".tmp-rows.arrow").write_bytes(b"partial")
    (out / ".tmp-arrow").mkdir()
    (out / "hidden_states/.tmp-hs_3.safetensors.x1").write_bytes(b"partial")
    (out / "hidden_states/hs_99.safetensors").write_bytes(b"stale")
    (out / "d2t-64.npy").write_bytes(b"stale")
    export_speculators(**export_inputs(results), out_dir=str(out), hidden_states="copy")
    assert tree_digest(out) == tree_digest(results / "export/speculators")


@pytest.mark.integration
def test_workflow_runs_the_export_rule_only_when_asked(tmp_path, small_demo_run):
    wd = shutil.copytree(small_demo_run, tmp_path / "wd", symlinks=True, ignore=shutil.ignore_patterns(".snakemake"))
    assert not re.search(r"^export\s", snakemake(wd, "-n").stdout, re.M)  # off by default
    # In the config file: `--config export={speculators: true}` reaches the schema as the string 'true'.
    config = yaml.safe_load((wd / "config/config.yaml").read_text())
    (wd / "config/config.yaml").write_text(yaml.safe_dump({**config, "export": {"speculators": True}}))
    run = snakemake(wd)
    assert "rule export:" in run.stdout + run.stderr
    log = run.stdout + run.stderr
    assert "rule extract_shard:" not in log and "rule validate_shard:" not in log  # finished stages left alone
    assert "rule report:" in log  # ... but the report records that the export ran, and where
    out = wd / "results/export/speculators"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["rows"] == json.loads((wd / "results/report/dataset_manifest.json").read_text())["rows"]
    assert (out / f"hidden_states/hs_{manifest['rows'] - 1}.safetensors").is_file()
    assert "[export] done" in (wd / "logs/export/speculators.log").read_text()
