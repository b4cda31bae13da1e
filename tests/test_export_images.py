"""Rows with images after extract (issue #28 item 6): the speculators export and the direct backend carry them
(input ids with the vision tokens, loss mask 0 there), the export's manifest counts them, and speculators' own
trainer trains on them, on the CPU, from both exports alike. The shards are tests/testkit/image_run.py's (random states
from the test writer: extract cannot take image rows on this branch)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file
from test_train import assert_identical_training

pytest.importorskip("speculators.train.cli", reason="speculators 0.9.0: make .venv/.installed")

from eagle3prep.train.rows import ExportRows  # noqa: E402

from testkit.train_both import Recipe, cpu_runner, make_exports, train_both  # noqa: E402

STEPS = 3
# a 1-layer draft over the 64 most frequent target ids, batches of up to 256 tokens (about five rows)
RECIPE = Recipe(seq_len=256, draft_vocab_size=64, ratio=0.85)


@pytest.fixture(scope="module")
def exports(image_run, tmp_path_factory) -> dict[str, Path]:
    """Both exports of the image run, as its export rule writes them."""
    return make_exports(image_run, tmp_path_factory.mktemp("image_exports"))


def tokenized_rows(wd: Path) -> list[dict]:
    paths = sorted((wd / "results/tokenized").glob("shard_*.jsonl"))
    return [json.loads(line) for p in paths for line in p.read_text().splitlines()]


def image_pad(model: Path) -> int:
    return json.loads((model / "config.json").read_text())["image_token_id"]


def test_the_export_carries_image_rows_with_their_vision_tokens_unmasked(image_run, tiny_vl_dir, exports):
    rows, pad = tokenized_rows(image_run), image_pad(tiny_vl_dir)
    image_rows = [r for r in rows if "images" in r]
    assert len(image_rows) == 5 and len(rows) == 8  # tests/testkit/image_run.py: 5 image rows among 8
    for mode, out in exports.items():
        manifest = json.loads((out / "manifest.json").read_text())
        assert (manifest["rows"], manifest["image_rows"], manifest["images"]) == (8, 5, 6), mode
        arrow = load_from_disk(str(out)).with_format(None)
        assert [a["input_ids"] for a in arrow] == [r["input_ids"] for r in rows]  # the vision tokens included
        assert [a["loss_mask"] for a in arrow] == [r["loss_mask"] for r in rows]
        for a in arrow:
            assert all(m == 0 for t, m in zip(a["input_ids"], a["loss_mask"], strict=True) if t == pad)
    assert sum(a["input_ids"].count(pad) for a in arrow) == 36  # stats.json's image_tokens
    # The direct backend serves each row exactly as the copy's hs file holds it, image rows included.
    direct = ExportRows.from_export(exports["direct"])
    for r in image_rows:
        want = load_file(exports["copy"] / f"hidden_states/hs_{r['row']}.safetensors")
        got = direct.get(r["row"])
        assert got["token_ids"].tolist() == r["input_ids"]
        assert all(torch.equal(got[k], want[k]) for k in want) and got["hidden_states"].shape[1] == 4


def cpu_runner_without_torchvision():
    """train_both.cpu_runner, with speculators' mask-token lookup given the verifier's tokenizer: it loads
    AutoProcessor, which for Qwen2.5-VL in transformers 5.19 needs torchvision (not in the CPU venvs; see
    testkit.tiny_vl). speculators' own rule then picks the id from that tokenizer."""
    import speculators.train.utils as utils
    from transformers import AutoTokenizer

    run = cpu_runner()

    def tokenizer_only(path, *, trust_remote_code=False):
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)

    def wrapped(argv: list[str]) -> None:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(utils, "load_processor", tokenizer_only)
            run(argv)

    return wrapped


def test_speculators_trains_on_image_rows_from_both_exports_alike(image_run, tiny_vl_dir, exports, tmp_path):
    rows = tokenized_rows(image_run)
    split = int(len(rows) * 0.85)  # speculators' --train-data-ratio boundary: both splits hold image rows
    assert sum("images" in r for r in rows[:split]) == 3 and all("images" in r for r in rows[split:])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "'pin_memory' argument is set as true but no accelerator")
        summary = train_both(tiny_vl_dir, exports, tmp_path, STEPS, RECIPE, cpu_runner_without_torchvision())
    assert_identical_training(tmp_path, summary, STEPS)
