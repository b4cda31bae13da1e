"""The report's data (eagle3prep.report.data) on small hand-made inputs, and the page on the demo run's outputs."""

from __future__ import annotations

import copy
import json

import pytest

from eagle3prep.report import build_report
from eagle3prep.report import data as rd


def test_funnel_accounts_for_every_row_and_names_the_reasons():
    counts = {"totals": {"rows_in": 20, "duplicates": 3, "kept": 14, "files": 2, "quarantined": {"bad": 2, "x": 1}}}
    stats = {"rows": 13, "tokens": 900, "max_seq_len": 64, "truncated_rows": 4, "quarantined": {"no_assistant": 1}}
    steps = {name: (n, note) for name, n, note in rd.funnel(counts, stats)}
    assert steps["quarantined by prepare"] == (-3, "bad 2, x 1")
    assert 20 + steps["duplicates dropped"][0] + steps["quarantined by prepare"][0] == 14
    assert 14 + steps["quarantined by tokenize"][0] == steps["rows out (tokenized, captured)"][0] == 13
    assert steps["truncated to 64 tokens (kept)"] == (4, "30.8% of rows; tokens cut: not in stats.json")
    steps = {name: note for name, _, note in rd.funnel(counts, {**stats, "truncated_tokens": 100})}
    assert steps["truncated to 64 tokens (kept)"].endswith("100 tokens cut (10.00% of all)")


def test_reference_skipped_in_new_and_old_validation_files():
    assert rd.reference_skipped({"rows": 5, "reference_mode": "off"})
    assert rd.reference_skipped({"rows": 5, "reference_mode": "full"})  # sample_rows: 0, nothing recomputed
    assert rd.reference_skipped({"rows": 5})  # an older file without the key
    assert not rd.reference_skipped({"rows": 5, "reference_mode": "full", "reference": [{"row": 0}]})
    assert not rd.reference_skipped({"rows": 0, "reference_mode": "full"})  # an empty shard has nothing to check


def test_reference_margins_from_layer_summaries_or_from_rows():
    new = {"reference_layers": {"8": {"worst_margin": 0.4}, "2": {"worst_margin": 0.9}}}
    old = {
        "reference": [{"layer_id": 2, "rel": 0.1, "bound_rel": 0.2}, {"layer_id": 2, "rel": 0.375, "bound_rel": 0.5}]
    }
    assert rd.reference_margins([new, old, {}]) == {"2": [0.9, 0.75, None], "8": [0.4, None, None]}


def test_check_grid_shows_failures_with_their_detail_and_a_skipped_reference():
    checks = [
        {"check": "manifest", "ok": True, "detail": ""},
        {"check": "file:layer_2.safetensors", "ok": True, "detail": "sha256 matches"},
        {"check": "file:layer_8.safetensors", "ok": False, "detail": "sha256 ab != cd"},
    ]
    columns, grid = rd.check_grid([{"rows": 3, "reference_mode": "off", "checks": checks}])
    row = dict(zip(columns, grid[0], strict=True))
    assert row["manifest"][0] == "ok"
    assert row["sha256"] == ("FAIL", "file:layer_8.safetensors: sha256 ab != cd")
    assert row["reference"][0] == "skipped" and row["token ids"][0] == "-"


def test_vocab_coverage_is_the_share_of_masked_tokens_in_the_top_ids():
    cov = rd.vocab_coverage({"7": 50, "3": 30, "9": 20}, sizes=(1, 2, 8))
    assert cov["at"] == {1: 0.5, 2: 0.8, 8: 1.0}
    assert cov["distinct_ids"] == 3 and cov["masked_tokens"] == 100
    assert cov["curve"][0] == (1, 0.5) and cov["curve"][-1] == (3, 1.0)


def test_sampled_outlier_share_reads_the_layer_file(tmp_path):
    import torch
    from safetensors.torch import save_file

    x = torch.ones(100, 4)  # token norm 2
    x[::10] *= 20  # every 10th token: norm 40
    save_file({"hidden_states": x.to(torch.bfloat16)}, tmp_path / "layer_2.safetensors")
    index = [{"row": r, "id": str(r), "offset": 10 * r, "length": 10} for r in range(10)]
    (tmp_path / "index.json").write_text(json.dumps(index))
    mean_norm = float(x.norm(dim=-1).mean())  # 5.8: the outliers are ~6.9x it, the rest 0.34x
    shares = rd.sampled_outlier_shares(tmp_path, {"layer_stats": {"2": {"mean_token_norm": mean_norm}}})
    assert shares == {"2": pytest.approx(0.1)}


def _report_inputs(wd, out, reports: list[dict]) -> dict:
    """build_report's arguments on a finished demo run, with the validation files replaced by `reports`."""
    n = len(reports)
    for k, v in enumerate(reports):
        (out / f"v{k}.json").write_text(json.dumps(v))
    return dict(
        validations=[str(out / f"v{k}.json") for k in range(n)],
        shard_dirs=[str(wd / f"results/hidden_states/shard_{k}") for k in range(n)],
        tokenized=[str(wd / f"results/tokenized/shard_{k}.jsonl") for k in range(n)],
        counts_path=str(wd / "results/prepared/counts.json"),
        stats_path=str(wd / "results/tokenized/stats.json"),
        token_freq_path=str(wd / "results/tokenized/token_freq.json"),
        benchmarks=[str(wd / f"benchmarks/extract/shard_{k}.tsv") for k in range(n)],
        out_html=str(out / "report.html"),
        out_csv=str(out / "summary.csv"),
        out_manifest=str(out / "dataset_manifest.json"),
    )


@pytest.mark.integration
def test_page_flags_a_skipped_reference_and_a_near_miss(small_demo_run, tmp_path):
    wd = small_demo_run
    reports = [json.loads((wd / f"results/validation/shard_{k}.json").read_text()) for k in range(3)]
    page = (wd / "results/report/report.html").read_text()
    assert "Every check passed on every shard, the reference check included." in page
    assert "Reference check SKIPPED" not in page and "Draft-vocabulary coverage" in page

    off = copy.deepcopy(reports)
    for v in off:  # what `validate.reference: false` writes
        v["reference_mode"] = "off"
        v["checks"] = [c for c in v["checks"] if not c["check"].startswith("reference")]
        for key in ("reference", "reference_layers", "reference_sample", "reference_floor"):
            v.pop(key, None)
    build_report(**_report_inputs(wd, tmp_path, off))
    page = (tmp_path / "report.html").read_text()
    assert "Reference check SKIPPED on every shard" in page and "<td class='skipped'" in page

    near = copy.deepcopy(reports)
    near[1]["reference_layers"]["5"]["worst_margin"] = 0.93
    dataset = build_report(**_report_inputs(wd, tmp_path, near))
    page = (tmp_path / "report.html").read_text()
    assert "Near the reference bound" in page and "layer 5: 0.93" in page
    assert dataset["sources"] == ["resources/demo/sharegpt.jsonl", "resources/demo/openai.parquet"]
    assert dataset["reference"].startswith(f"{sum(v['reference_sample']['rows'] for v in near)} of ")
    assert "src='data:image/png;base64," in page  # self-contained: the figures are inlined
