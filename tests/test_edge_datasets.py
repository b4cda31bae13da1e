"""Datasets at the edges, through the `snakemake` CLI on the CPU demo model: nothing survives prepare (every
record quarantined, an empty file, a file of blank lines), and fewer conversations than shards.

A file whose every record is quarantined stops the run in the prepare job with one line naming the file, the
reasons and data.max_quarantine_share, the quarantine kept beside the log (a failed job loses its outputs); a source
file that holds no record stops it there too, in one line naming the file. Fewer rows than shards gives empty shards
that are written without an engine, validated, reported, exported and loaded like the others.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_bad_inputs import BAD, good_line, merged

from eagle3prep.export.dataset import HiddenStatesDataset

from testkit.workflow import SMALL_CONFIG, make_workdir, snakemake

pytestmark = pytest.mark.integration

H = 128  # the demo model's hidden size
# One line from each of three corpus files (tests/data/bad/sources), each quarantined for a different reason.
ALL_BAD = [("invalid_json_unterminated.jsonl", 2), ("unknown_role.jsonl", 2), ("no_assistant_turn.jsonl", 2)]


def corpus_line(name: str, line: int) -> str:
    return (BAD / "sources" / name).read_text(encoding="utf-8").splitlines()[line - 1]


def edge_workdir(path: Path, model_dir: Path, sources: dict[str, str], **override) -> Path:
    """A workdir whose only sources are `sources` ({name: text}), on the session's demo model."""
    config = merged(
        SMALL_CONFIG,
        {"data": {"sources": list(sources)}, "model": {"path": str(model_dir), "build_demo": False}, **override},
    )
    wd = make_workdir(path, config)
    for name, text in sources.items():
        (wd / name).write_text(text, encoding="utf-8")
    return wd


# ------------------------------------------------------------------------------------------ nothing kept


def test_a_file_with_every_record_quarantined_stops_the_prepare_job_with_one_line(tmp_path, demo_model_dir):
    wd = edge_workdir(tmp_path, demo_model_dir, {"all_bad.jsonl": "".join(corpus_line(*at) + "\n" for at in ALL_BAD)})
    proc = snakemake(wd, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    message = (
        "error: all_bad.jsonl: prepare quarantined 3 of its 3 rows (all; invalid_json 1, unknown_role 1, "
        "no_assistant_turn 1), a file that loses every row fails whatever data.max_quarantine_share is (now 0.5); "
        "each record and its reason is in logs/prepare.quarantine.jsonl: fix the file or drop it from data.sources"
    )
    assert (wd / "logs/prepare.log").read_text().splitlines()[-1] == message
    assert message in proc.stderr  # the profile's show-failed-logs prints it under the failed job
    quarantine = [json.loads(x) for x in (wd / "logs/prepare.quarantine.jsonl").read_text().splitlines()]
    assert [(q["line"], q["reason"]) for q in quarantine] == [(1, "invalid_json"), (2, "unknown_role"),
                                                               (3, "no_assistant_turn")]  # fmt: skip
    assert sorted(p.name for p in (wd / "results").iterdir() if p.is_file() or any(p.iterdir())) == ["config.json"]


NOTHING_KEPT = {
    "empty_file": ({"empty.jsonl": (BAD / "sources/empty.jsonl").read_text()}, "an empty file"),
    "blank_lines_only": (
        {"blank_lines_only.jsonl": (BAD / "sources/blank_lines_only.jsonl").read_text()},
        "only 4 blank lines",
    ),
}


@pytest.mark.parametrize("case", list(NOTHING_KEPT))
def test_a_source_file_without_records_stops_the_prepare_job_with_one_line(case, tmp_path, demo_model_dir):
    """An empty file (or blank lines only) is an error naming it; before, it passed as `0 rows in, 0 kept`."""
    sources, what = NOTHING_KEPT[case]
    wd = edge_workdir(tmp_path, demo_model_dir, sources)
    proc = snakemake(wd, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    name = next(iter(sources))
    message = (
        f"error: {name}: no records ({what}); a source file must hold conversations: fix the file or drop it from "
        "data.sources"
    )
    assert (wd / "logs/prepare.log").read_text().splitlines()[-1] == message
    assert message in proc.stderr  # the profile's show-failed-logs prints it under the failed job
    # Nothing after it ran: no empty "successful" dataset (config.json: the record of the config that made the folder).
    assert sorted(p.name for p in (wd / "results").iterdir() if p.is_file() or any(p.iterdir())) == ["config.json"]


# ------------------------------------------------------------------------------- fewer rows than shards


@pytest.fixture(scope="module")
def few_rows_run(tmp_path_factory, demo_model_dir) -> Path:
    """2 conversations kept (of 5 records) for 3 shards: shard 2 is empty."""
    duplicate = good_line(1)
    sources = {
        "few.jsonl": "".join(
            x + "\n"
            for x in [good_line(1), corpus_line("no_assistant_turn.jsonl", 2), duplicate, "{oops", good_line(2)]
        ),
    }
    wd = edge_workdir(
        tmp_path_factory.mktemp("few_rows"),
        demo_model_dir,
        sources,
        tokenize={"num_shards": 3},
        export={"speculators": True},
    )
    snakemake(wd)
    return wd


def test_fewer_rows_than_shards_makes_empty_shards_that_validate(few_rows_run):
    res = few_rows_run / "results"
    counts = json.loads((res / "prepared/counts.json").read_text())
    assert [(f["file"], f["rows_in"], f["kept"]) for f in counts["files"]] == [("few.jsonl", 5, 2)]
    t = counts["totals"]
    assert (t["duplicates"], t["quarantined_total"], t["blank_lines"]) == (1, 2, 0)

    tokenized = [
        [json.loads(x) for x in (res / f"tokenized/shard_{k}.jsonl").read_text().splitlines()] for k in range(3)
    ]
    assert [[r["row"] for r in rows] for rows in tokenized] == [[0], [1], []]
    manifests = [json.loads((res / f"hidden_states/shard_{k}/manifest.json").read_text()) for k in range(3)]
    assert [(m["rows"], m["row_range"]) for m in manifests] == [(1, [0, 1]), (1, [1, 2]), (0, [0, 0])]
    assert [m["tokens"] for m in manifests] == [rows[0]["seq_len"] for rows in tokenized[:2]] + [0]
    assert [m["engine"]["capture_path"] for m in manifests] == ["hf_hooks", "hf_hooks", "none (no rows)"]
    empty = res / "hidden_states/shard_2"
    assert load_file(empty / "layer_8.safetensors")["hidden_states"].shape == (0, H)
    assert load_file(empty / "token_ids.safetensors")["token_ids"].shape == (0,)
    assert json.loads((empty / "index.json").read_text()) == []

    validations = [json.loads((res / f"validation/shard_{k}.json").read_text()) for k in range(3)]
    assert all(v["ok"] and all(c["ok"] for c in v["checks"]) for v in validations)
    checks = {c["check"]: c["detail"] for c in validations[2]["checks"]}
    assert checks["row_count"] == "index 0 rows, tokenized shard 0" and "token_ids" in checks
    assert "reference" not in validations[2]  # no row to recompute; shards 0 and 1 had theirs
    assert all(v["reference"] for v in validations[:2])

    dataset = json.loads((res / "report/dataset_manifest.json").read_text())
    assert dataset["rows"] == 2 and [s["rows"] for s in dataset["shards"]] == [1, 1, 0]
    assert dataset["engine"] == manifests[0]["engine"]  # the engine that captured rows
    assert dataset["prepare"]["kept"] == 2 and dataset["tokenize"]["rows"] == 2
    summary = list(csv.DictReader((res / "report/summary.csv").read_text().splitlines()))
    assert [(r["shard"], r["rows"], r["validation_ok"]) for r in summary] == [
        ("0", "1", "True"),
        ("1", "1", "True"),
        ("2", "0", "True"),
    ]


def test_empty_shards_load_as_no_rows_in_the_dataset_and_the_export(few_rows_run):
    res = few_rows_run / "results"
    rows = [json.loads(x) for k in range(3) for x in (res / f"tokenized/shard_{k}.jsonl").read_text().splitlines()]
    out = res / "export/speculators"
    export = json.loads((out / "manifest.json").read_text())
    assert export["rows"] == 2
    assert sorted(p.name for p in (out / "hidden_states").iterdir()) == ["hs_0.safetensors", "hs_1.safetensors"]

    ds = HiddenStatesDataset.from_results(res)
    assert len(ds) == 2 and ds.approx_lengths == [r["seq_len"] for r in rows]
    for i, r in enumerate(rows):
        item, hs = ds[i], load_file(out / f"hidden_states/hs_{i}.safetensors")  # [T, L, H]
        assert item["input_ids"].tolist() == hs["token_ids"].tolist() == r["input_ids"]
        assert item["loss_mask"].tolist() == r["loss_mask"]
        assert torch.equal(item["hidden_states"], hs["hidden_states"][:, :-1].flatten(1))  # [T, 3H]
        assert torch.equal(item["verifier_last_hidden_states"], hs["hidden_states"][:, -1])  # [T, H]

    data = pytest.importorskip("speculators.train.data", reason="speculators 0.9.0: make .venv/.installed")
    spec = data.ArrowDataset(max_len=256, datapath=str(out), on_missing="raise")
    assert len(spec) == 2 and torch.equal(spec[1]["input_ids"], ds[1]["input_ids"])


def test_plan_names_the_empty_shards(few_rows_run, tmp_path):
    wd = shutil.copytree(few_rows_run, tmp_path / "wd", symlinks=True, ignore=shutil.ignore_patterns(".snakemake"))
    snakemake(wd, "plan")
    assert (
        "empty shards: 1 of 3 hold no rows (2 rows for 3 shards); they start no engine and validate, but each "
        "is still a job; set tokenize.num_shards to 2 or fewer to avoid them"
    ) in (wd / ".eagle3prep/plan/plan.txt").read_text()
