"""A report that a run did not rebuild never reads as the truth (eagle3prep.report.stale, eagle3prep.run.closing), and
the report's banner is green only when every shard of the config passed, with set-aside copies and lossy source
files named (eagle3prep.report.page.banners)."""

import json
import os
import re
import time
from pathlib import Path

import pytest

from eagle3prep import paths
from eagle3prep.healing import heal
from eagle3prep.report import page, stale
from eagle3prep.run import closing

GREEN = "Every check passed on every shard"


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def old_report(text: str = f"<html><body><div class='banner good'>{GREEN}</div></body></html>") -> Path:
    path = Path(stale.REPORT)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    past = time.time_ns() - 60 * 10**9
    os.utime(path, ns=(past, past))
    return path


def failed_shard(k: int) -> None:
    folder = Path(heal.shard_dir(k))
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    verdict = Path(paths.validation_failure(k))
    verdict.parent.mkdir(parents=True, exist_ok=True)
    verdict.write_text(json.dumps({"ok": False, "checks": [{"check": "sha256", "ok": False, "detail": "1 != 2"}]}))
    later = time.time_ns() + 10**9
    os.utime(verdict, ns=(later, later))


def test_the_stale_banner_goes_at_the_top_once_and_names_each_reason():
    path = old_report()
    assert stale.mark_stale(["shard_6 failed validation"], path)
    assert stale.mark_stale(["shard_6 failed validation", "shard_7 changed"], path)
    text = path.read_text()
    assert text.count(stale.MARK_START) == 1 and stale.is_stale(path)
    assert text.index("STALE") < text.index(GREEN)
    assert "<li>shard_7 changed</li>" in text
    assert not stale.mark_stale(["x"], "results/report/none.html")


def test_a_stale_report_shows_no_green_and_the_failure_comes_first():
    """Before: the red STALE banner went on top, with "Every check passed on every shard" and "4 / 4" right under."""
    ok = {"ok": True, "checks": [{"check": "sha256", "ok": True}]}
    c = ctx([ok] * 4, shards=4, counts={}, stats={}, coverage={"at": {}})
    body = "".join(page.banners(c)) + stale.while_current("", stale.STALE_VERDICTS)
    kpis = page.kpis(c | {"dataset": {"shards": [{}] * 4, "rows": 8, "tokens": 80, "bytes": 1, "layer_ids": [2]},
                          "counts": {"files": [], "totals": {"rows_in": 8}}})  # fmt: skip
    path = old_report(f"<html><body><h1>report</h1>{body}{kpis}</body></html>")
    fresh = re.sub("<!--.*?-->", "", path.read_text())  # what a browser shows
    assert GREEN in fresh and "<b>4 / 4</b>" in fresh and "STALE" not in fresh
    assert stale.mark_stale(["results/hidden_states/shard_1 failed validation"], path)
    text = path.read_text()
    assert GREEN not in text and "4 / 4" not in text and "class='banner good'" not in text
    assert text.startswith(f"<html><body>{stale.MARK_START}<div class='banner bad'>STALE")  # first on the page
    assert "<b>STALE: see the top of the page</b>" in text and "verdicts below are from before the changes" in text
    assert stale.mark_stale(["again"], path) and path.read_text().count("STALE: see the top") == 1


def test_a_failed_run_marks_an_older_report_with_the_failed_validation():
    path = old_report()
    failed_shard(6)
    assert closing.mark_report_after_failure([5, 6], started_ns=time.time_ns())
    text = path.read_text()
    assert "results/hidden_states/shard_6 failed validation (logs/validate/shard_6.log)" in text


def test_a_report_this_run_rebuilt_is_left_alone():
    path = old_report()
    started = time.time_ns()
    path.write_text(f"<html><body>{GREEN}</body></html>")  # rebuilt by this run
    assert not closing.mark_report_after_failure([0], started_ns=started - 10**9)
    assert not stale.is_stale(path)


def test_set_aside_copies_are_listed_with_their_error():
    copy = Path(stale.FAILED) / "shard_6"
    copy.mkdir(parents=True)
    (copy / "validation.json").write_text(
        json.dumps({"checks": [{"check": "sha256", "ok": False, "detail": "1 != 2"}]})
    )
    (Path(stale.FAILED) / "shard_6.1").mkdir()
    assert stale.set_aside_shards() == [
        {"dir": "results/failed/shard_6", "why": "1 check(s) failed: sha256 (1 != 2)"},
        {"dir": "results/failed/shard_6.1", "why": "failed validation"},
    ]


def ctx(reports, shards=2, **extra):
    return {"reference_skipped": [], "reports": reports, "margins": {}, "dataset": {"shards": [{}] * shards}, **extra}


def test_the_banner_is_green_only_when_every_shard_of_the_config_passed():
    ok = {"ok": True, "checks": [{"check": "sha256", "ok": True}]}
    assert GREEN in "".join(page.banners(ctx([ok, ok])))
    assert GREEN not in "".join(page.banners(ctx([ok, {"ok": False}])))
    assert GREEN not in "".join(page.banners(ctx([ok], shards=2)))


def test_set_aside_shards_and_lossy_files_are_in_the_banners():
    ok = {"ok": True, "checks": []}
    losses = [
        {"file": "good.jsonl", "rows_in": 10, "duplicates": 0, "lost": {"prepare": {}}, "rows_out": 10},
        {"file": "odd.parquet", "rows_in": 4, "duplicates": 0, "lost": {"prepare": {"unknown_shape": 3}},
         "rows_out": 1},
    ]  # fmt: skip
    text = "".join(
        page.banners(ctx([ok], shards=1, set_aside=[{"dir": "results/failed/shard_6", "why": "sha256"}],
                         source_losses=losses))
    )  # fmt: skip
    assert "<div class='banner bad'>1 shard copy failed validation and was set aside" in text
    assert "<code>results/failed/shard_6</code>: sha256" in text
    assert "<code>odd.parquet</code>: 4 rows in, 1 kept, 3 quarantined (unknown_shape 3)" in text
    assert "good.jsonl" not in text
    # Duplicates are named too, so the numbers add up (rows in = kept + duplicates + quarantined).
    losses[1] |= {"rows_in": 6, "duplicates": 2}
    assert "<code>odd.parquet</code>: 6 rows in, 1 kept, 2 duplicates, 3 quarantined (unknown_shape 3)" in "".join(
        page.banners(ctx([ok], shards=1, source_losses=losses))
    )


def test_the_end_of_a_run_counts_rows_in_and_kept_per_file_when_any_were_quarantined():
    counts = {
        "files": [
            {"file": "a.jsonl", "rows_in": 10, "kept": 9, "duplicates": 1, "quarantined": {"bad_json": 0},
             "quarantined_total": 0},
            {"file": "b.parquet", "rows_in": 5, "kept": 3, "duplicates": 0, "quarantined": {"unknown_shape": 2},
             "quarantined_total": 2},
        ]
    }  # fmt: skip
    Path(closing.PREPARED_COUNTS).parent.mkdir(parents=True)
    Path(closing.PREPARED_COUNTS).write_text(json.dumps(counts))
    Path(closing.TOKENIZED_QUARANTINE).parent.mkdir(parents=True)
    Path(closing.TOKENIZED_QUARANTINE).write_text(
        json.dumps({"reason": "no_assistant_tokens", "record": {"source": "a.jsonl:3"}}) + "\n"
    )
    lines = closing.run_losses()
    assert lines[1:] == [
        "  a.jsonl: 10 rows in, 8 kept, 1 duplicates, 1 quarantined (no_assistant_tokens 1)",
        "  b.parquet: 5 rows in, 3 kept, 2 quarantined (unknown_shape 2)",
    ]
    counts["files"][1].update(kept=5, quarantined={"unknown_shape": 0}, quarantined_total=0)
    Path(closing.PREPARED_COUNTS).write_text(json.dumps(counts))
    Path(closing.TOKENIZED_QUARANTINE).unlink()
    assert closing.run_losses() == []


def test_a_failed_shard_kept_in_place_fails_every_later_run_and_the_report_says_stale(small_demo_run, tmp_path):
    """Through real `snakemake` runs on the demo: a byte flipped in a finished shard's layer file (written through
    a rename, as an editor does, so the folder's date moves). Before: with heal.keep_failed the rerun said
    "Nothing to be done", exit 0, and the report stayed green."""
    import shutil

    from testkit.workflow import snakemake

    wd = shutil.copytree(small_demo_run, tmp_path / "wd", symlinks=True)
    layer = wd / "results/hidden_states/shard_1/layer_4.safetensors"
    data = bytearray(layer.read_bytes())
    data[-8] ^= 0xFF
    tmp = layer.with_name("layer_4.tmp")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, layer)
    report = wd / stale.REPORT
    assert GREEN in report.read_text() and not stale.is_stale(report)

    first = snakemake(wd, "--config", "heal={keep_failed: true}", check=False)
    assert first.returncode != 0, first.stderr[-3000:]
    assert "results/hidden_states/shard_1 changed after results/validation/shard_1.json" in first.stderr
    assert "1 check(s) failed: file:layer_4.safetensors" in first.stderr, first.stderr[-3000:]
    assert stale.is_stale(report)
    text = report.read_text()
    assert text.index("<div class='banner bad'>STALE") < text.index("<h1>") and GREEN not in text
    assert "results/hidden_states/shard_1 failed validation (logs/validate/shard_1.log)" in text

    # Kept in place: every later run fails too, before and after the shard is validated again.
    for _ in range(2):
        again = snakemake(wd, "--config", "heal={keep_failed: true}", check=False)
        assert again.returncode != 0, again.stderr[-3000:]
        assert "Nothing to be done" not in again.stdout + again.stderr
        assert (
            "eagle3prep: results/hidden_states/shard_1 failed validation (logs/validate/shard_1.log); kept in place "
            "(heal.keep_failed)" in again.stderr
        )
        assert stale.is_stale(report) and "shard_1 failed validation" in report.read_text()
    assert not (wd / "results/validation/shard_1.json").exists()
    assert (wd / "results/hidden_states/shard_1/layer_4.safetensors").read_bytes() == bytes(data)

    # The default heal sets it aside and redoes it; the rebuilt report is not stale and names the set-aside copy.
    healed = snakemake(wd, check=False)
    assert healed.returncode == 0, healed.stderr[-3000:]
    text = report.read_text()
    assert not stale.is_stale(report) and GREEN in text
    assert "<div class='banner bad'>1 shard copy failed validation and was set aside" in text
    assert "<code>results/failed/shard_1</code>" in text
