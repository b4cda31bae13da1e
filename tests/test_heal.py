"""eagle3prep.run.heal on a fake results folder: which shards the same command redoes, and why (one line each)."""

import json
import os
import shutil
from pathlib import Path

import pytest

from eagle3prep.run import heal


def finished(k: int, validated: bool = True) -> Path:
    folder = Path(heal.shard_dir(k))
    folder.mkdir(parents=True)
    (folder / "layer_2.safetensors").write_bytes(b"x")
    (folder / "manifest.json").write_text("{}")
    if validated:
        val = Path(heal.validation_json(k))
        val.parent.mkdir(parents=True, exist_ok=True)
        val.write_text('{"ok": true}')
        later = folder.stat().st_mtime_ns + 10**9
        os.utime(val, ns=(later, later))
    return folder


def failed_log(k: int, manifest_newer: bool = False) -> None:
    log = Path(heal.validate_log(k))
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(
        "[validate] ok   manifest: \n[validate] FAIL file:layer_2.safetensors: sha256 1 != 2\n"
        f"error: {heal.shard_dir(k)}: 1 check(s) failed: file:layer_2.safetensors (sha256 1 != 2)\n"
    )
    manifest = Path(heal.shard_dir(k)) / "manifest.json"
    t = manifest.stat().st_mtime_ns + (-(10**9) if manifest_newer else 10**9)
    os.utime(log, ns=(t, t))


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def test_a_fresh_folder_or_a_healthy_run_heals_nothing():
    assert heal.find(range(3)) == []
    for k in range(3):
        finished(k)
    Path("results/report").mkdir(parents=True)
    Path("results/report/dataset_manifest.json").write_text("{}")
    assert heal.find(range(3)) == []


def test_a_deleted_finished_shard_is_extracted_again():
    # Snakemake alone said "Nothing to be done": the shard is an intermediate its validation no longer needs.
    for k in range(3):
        finished(k)
    shutil.rmtree(heal.shard_dir(2))
    [h] = heal.find(range(3))
    assert (h.shard, h.force, h.set_aside) == (2, "results/hidden_states/shard_2", False)
    assert h.why == (
        "results/hidden_states/shard_2 is missing but results/validation/shard_2.json exists: extracting it again"
    )


def test_unfinished_changed_and_unvalidated_shards():
    for k in range(4):
        finished(k)
    (Path(heal.shard_dir(0)) / "manifest.json").unlink()  # a run stopped while writing it
    (Path(heal.shard_dir(1)) / "layer_2.safetensors").unlink()  # the folder changed after validation
    os.utime(heal.shard_dir(1), ns=(2 * 10**18, 2 * 10**18))
    Path(heal.validation_json(2)).unlink()  # validation gone, report made from it
    Path("results/report").mkdir(parents=True)
    Path("results/report/dataset_manifest.json").write_text("{}")
    heals = {h.shard: h for h in heal.find(range(4))}
    assert sorted(heals) == [0, 1, 2]
    assert heals[0].force == heal.shard_dir(0) and "has no manifest.json" in heals[0].why
    assert heals[1].force == heal.validation_json(1) and "changed after" in heals[1].why
    assert (
        heals[2].force == heal.validation_json(2) and "validating results/hidden_states/shard_2 again" in heals[2].why
    )


def test_a_shard_that_failed_validation_is_set_aside_and_redone(tmp_path):
    finished(0)
    finished(1, validated=False)
    failed_log(1)
    Path("logs/extract").mkdir(parents=True)
    Path("logs/extract/shard_1.log").write_text("tok/s")
    [h] = heal.find(range(2))
    assert (h.shard, h.force, h.set_aside) == (1, heal.shard_dir(1), True)
    assert h.why.startswith("results/hidden_states/shard_1 failed validation (results/hidden_states/shard_1: 1 check")
    assert h.why.endswith("moving it to results/failed/shard_1 and extracting it again")
    assert heal.set_aside(h) == "results/failed/shard_1"
    assert not Path(heal.shard_dir(1)).exists()
    kept = Path("results/failed/shard_1")
    assert sorted(p.name for p in kept.iterdir()) == ["extract.log", "hidden_states", "validate.log"]
    assert (kept / "hidden_states/manifest.json").is_file() and "FAIL" in (kept / "validate.log").read_text()


def test_failed_shards_are_kept_on_request_and_redone_at_most_twice():
    finished(1, validated=False)
    failed_log(1)
    # Kept or given up on, the shard is validated again, so the run fails while it stays damaged.
    [h] = heal.find([1], keep_failed=True)
    assert h.force == heal.validation_json(1) and not h.set_aside
    assert "kept in place (heal.keep_failed): validating it again" in h.why and "the run fails" in h.why
    Path("results/failed/shard_1").mkdir(parents=True)
    assert heal.find([1])[0].why.endswith("moving it to results/failed/shard_1.1 and extracting it again")
    Path("results/failed/shard_1.1").mkdir()
    [h] = heal.find([1])
    assert h.force == heal.validation_json(1) and "after 2 redos" in h.why and "the run fails" in h.why


def test_a_dry_run_says_it_would_move_a_failed_shard():
    finished(1, validated=False)
    failed_log(1)
    [h] = heal.find([1], dryrun=True)
    assert "would move it (not in a dry run) to results/failed/shard_1" in h.why and "moving it" not in h.why


def test_a_validation_log_older_than_the_shard_or_without_a_verdict_is_no_failure():
    finished(1, validated=False)
    failed_log(1, manifest_newer=True)  # the shard was redone after that validation
    assert heal.find([1]) == []
    Path(heal.validate_log(1)).write_text("interrupted (Ctrl-C): ...\n")
    assert heal.find([1]) == []


def test_summary_is_one_line_per_shard_then_a_count():
    heals = [heal.Heal(k, f"shard {k}") for k in range(25)]
    lines = heal.summary(heals)
    assert len(lines) == 11 and lines[-1] == "... and 15 more shards (the first 10 are listed above)"


def test_healing_stops_the_parse_when_snakemake_lacks_the_internal_it_wraps():
    """Pinned: the installed Snakemake has what rules/common.smk wraps; one without it gets one line."""
    import snakemake.api  # noqa: F401  (snakemake.workflow imports itself through the api first)
    from snakemake.workflow import Workflow

    assert heal.snakemake_hook_error(Workflow) is None, "Snakemake renamed Workflow._prepare_dag or dag_settings"
    line = heal.snakemake_hook_error(object())
    assert line.startswith("error: this Snakemake") and "_prepare_dag" in line and "\n" not in line


def test_a_snakemake_without_the_internal_stops_the_dry_run_in_one_line(tmp_path):
    """The workflow's parse, with Workflow._prepare_dag removed as a later release could: one line, exit != 0
    (before the check, healing switched itself off and the run went on)."""
    import subprocess
    import sys

    from testkit.workflow import REPO

    code = (
        "import sys, snakemake.api, snakemake.workflow as w; del w.Workflow._prepare_dag; "
        "from snakemake.cli import main; sys.argv = ['snakemake', '-n', '--snakefile', sys.argv[1]]; main()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "Snakefile")], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    assert "has no Workflow._prepare_dag, which eagle3prep's healing wraps" in proc.stderr, proc.stderr[-2000:]


def test_shards_the_report_was_not_made_from_are_not_extracted_yet_rather_than_missing():
    """Issue #27 item 5: a second config with more shards in the same folder said `shard_4 is missing but
    results/report/dataset_manifest.json exists: extracting it again`, which reads like data loss."""
    for k in range(4):
        finished(k)
    Path("results/report").mkdir(parents=True)
    shards = [{"shard": k, "dir": heal.shard_dir(k)} for k in range(4)]
    Path("results/report/dataset_manifest.json").write_text(json.dumps({"shards": shards}))
    shutil.rmtree(heal.shard_dir(3))  # shard 3 was made, then lost with its validation
    Path(heal.validation_json(3)).unlink()
    heals = {h.shard: h for h in heal.find(range(6))}
    assert sorted(heals) == [3, 4, 5] and {h.force for h in heals.values()} == {heal.shard_dir(k) for k in (3, 4, 5)}
    assert (
        heals[4].why
        == "results/hidden_states/shard_4: not extracted yet (not in results/report/dataset_manifest.json)"
    )
    assert heals[3].why == (
        "results/hidden_states/shard_3 is missing but results/report/dataset_manifest.json exists: extracting it again"
    )


def test_an_export_manifest_lists_its_shards_too():
    finished(0)
    Path(heal.validation_json(0)).unlink()
    export = Path("results/export/speculators")
    export.mkdir(parents=True)
    (export / "manifest.json").write_text(json.dumps({"sources": [{"shard_dir": heal.shard_dir(0)}]}))
    assert heal.shards_made_into(str(export)) == {os.path.normpath(heal.shard_dir(0))}
    assert heal.shards_made_into("results/nothing.json") is None


def listed(k: int) -> Path:
    """A finished, validated shard whose manifest lists its layer file, as extract writes it."""
    folder = finished(k)
    (folder / "manifest.json").write_text(json.dumps({"files": {"layer_2.safetensors": {"sha256": "s", "bytes": 1}}}))
    val = Path(heal.validation_json(k))
    later = folder.stat().st_mtime_ns + 10**9
    os.utime(val, ns=(later, later))
    return folder


def test_a_deleted_or_added_file_is_extracted_again_at_once_not_validated_to_fail_first():
    # Before: "validating it again", a validation that fails ("listed in the manifest but missing"), then a
    # second run to set the shard aside and extract it.
    for k in range(3):
        listed(k)
    (Path(heal.shard_dir(0)) / "layer_2.safetensors").unlink()
    (Path(heal.shard_dir(1)) / "notes.txt").write_text("x")
    (Path(heal.shard_dir(2)) / ".snakemake_timestamp").write_text("")  # Snakemake's own marker: no change
    for k in range(3):
        os.utime(heal.shard_dir(k), ns=(2 * 10**18, 2 * 10**18))
    heals = {h.shard: h for h in heal.find(range(3))}
    assert heals[0].force == heal.shard_dir(0) and heals[0].why == (
        "results/hidden_states/shard_0: layer_2.safetensors is listed in its manifest.json but missing: "
        "extracting it again"
    )
    assert heals[1].force == heal.shard_dir(1) and "notes.txt is not in its manifest.json" in heals[1].why
    assert heals[2].force == heal.validation_json(2) and "validating it again" in heals[2].why


def test_what_verify_found_damaged_is_made_again_once():
    for k in range(3):
        finished(k)
    export = Path(heal.EXPORT)
    export.mkdir(parents=True)
    (export / "manifest.json").write_text("{}")
    places = {
        "hidden_states/shard_1": "shard_1/layer_2.safetensors: sha256 aaa != bbb",
        "export/speculators": "export/speculators/token_freq.pt: sha256 ccc != ddd",
    }
    Path(heal.VERIFIED).write_text(json.dumps({"places": places}))
    later = (export / "manifest.json").stat().st_mtime_ns + 10**9
    os.utime(heal.VERIFIED, ns=(later, later))
    heals = {h.shard: h for h in heal.find(range(3))}
    assert heals[1].force == heal.shard_dir(1) and heals[1].why == (
        "results/hidden_states/shard_1: shard_1/layer_2.safetensors: sha256 aaa != bbb (results/verify.json): "
        "extracting it again"
    )
    assert heals[None].force == heal.EXPORT and "exporting it again" in heals[None].why
    assert set(heals) == {1, None}
    # made again after verify ran: nothing more to do
    for manifest in (Path(heal.shard_dir(1)) / "manifest.json", export / "manifest.json"):
        os.utime(manifest, ns=(later + 10**9, later + 10**9))
    assert heal.find(range(3)) == []


def test_the_files_a_shard_may_hold_beyond_its_listing_are_the_shard_modules():
    # heal keeps its own copy (the Snakefile's parse does not import the shard package).
    from eagle3prep.shard.manifest import SHARD_EXTRAS

    assert heal.SHARD_EXTRAS == SHARD_EXTRAS
