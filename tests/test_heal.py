"""eagle3prep.healing.heal on a fake results folder: which shards the same command redoes, and why (one line each)."""

import json
import os
import shutil
from pathlib import Path

import pytest

from eagle3prep import paths
from eagle3prep.healing import heal, tickets
from eagle3prep.infra.mode import Mode


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
    """What a failed validation leaves: its log, and its report under paths.validation_failure (the verdict)."""
    log = Path(heal.validate_log(k))
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("[validate] ok   manifest: \n[validate] FAIL file:layer_2.safetensors: sha256 1 != 2\n")
    verdict = Path(paths.validation_failure(k))
    verdict.parent.mkdir(parents=True, exist_ok=True)
    checks = [{"check": "manifest", "ok": True, "detail": ""},
              {"check": "file:layer_2.safetensors", "ok": False, "detail": "sha256 1 != 2"}]  # fmt: skip
    verdict.write_text(json.dumps({"ok": False, "checks": checks}))
    manifest = Path(heal.shard_dir(k)) / "manifest.json"
    t = manifest.stat().st_mtime_ns + (-(10**9) if manifest_newer else 10**9)
    for path in (log, verdict):
        os.utime(path, ns=(t, t))


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
    assert sorted(p.name for p in kept.iterdir()) == [
        "extract.log",
        "hidden_states",
        "validate.log",
        "validation.json",
    ]
    assert (kept / "hidden_states/manifest.json").is_file() and "FAIL" in (kept / "validate.log").read_text()
    assert not Path(paths.validation_failure(1)).exists()


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


def test_a_failed_verdict_older_than_the_shard_or_none_at_all_is_no_failure():
    """The verdict is the report validation kept, never the log's text: a log that says FAIL decides nothing."""
    finished(1, validated=False)
    failed_log(1, manifest_newer=True)  # the shard was redone after that validation
    assert heal.find([1]) == []
    Path(paths.validation_failure(1)).unlink()  # a job that stopped before judging leaves none
    os.utime(heal.validate_log(1))
    assert heal.find([1]) == []


def test_summary_is_one_line_per_shard_then_a_count():
    heals = [heal.Heal(k, f"shard {k}") for k in range(25)]
    lines = heal.summary(heals)
    assert len(lines) == 11 and lines[-1] == "... and 15 more shards (the first 10 are listed above)"


def healing(main=True, dry=False, **kw):
    said = []
    h = tickets.Healing(range(3), False, main=main, mode=lambda: Mode(executor=True, dry=dry), say=said.append, **kw)
    h.prepare()  # at parse time
    return h, said


def test_a_job_to_redo_gets_this_runs_ticket_newer_than_its_outputs_and_keeps_it_once_healed():
    """Healing through Snakemake's own rules: the redone job's one more input is the next ticket, written at parse
    time, so it is there and newer than the job's outputs (Snakemake's mtime trigger, no metadata needed); once
    carried out, the next run asks the same input of that job (nothing re-queued) and none of the others."""
    for k in range(3):
        finished(k)
    shutil.rmtree(heal.shard_dir(2))
    h, said = healing()
    assert h.ticket("extract/2") == [".eagle3prep/heal/1.json"] and h.ticket("extract/0") == []
    assert h.ticket("validate/2") == [] and said == [
        f"{heal.shard_dir(2)} is missing but {heal.validation_json(2)} exists: extracting it again"
    ]
    ticket = Path(".eagle3prep/heal/1.json")
    assert ticket.stat().st_mtime_ns > Path(heal.validation_json(2)).stat().st_mtime_ns
    # Not carried out yet (a run refused before onstart): no later run takes it as a job's last ticket.
    assert tickets.read_tickets() == {1: None} and healing(main=False)[0].ticket("extract/2") == []
    assert h.carry_out() == [f"redo extract/2: {said[0]}"]
    assert json.loads(ticket.read_text())["jobs"] == ["extract/2"] and json.loads(ticket.read_text())["started"]
    assert Path("logs/heal/1.log").read_text() == f"[heal] redo extract/2: {said[0]}\n"
    assert healing(main=False)[0].ticket("extract/2") == [str(ticket)]  # a spawned job's process: the same input
    finished(2)  # what the redone job made
    again, said = healing()
    assert again.ticket("extract/2") == [".eagle3prep/heal/1.json"] and again.ticket("extract/1") == [] and not said
    assert not Path(".eagle3prep/heal/2.json").exists()  # nothing due: no ticket
    shutil.rmtree(heal.shard_dir(2))  # damaged again: the next ticket, and the other shards keep theirs
    third, _ = healing()
    assert third.ticket("extract/2") == [".eagle3prep/heal/2.json"]


def test_a_ticket_not_carried_out_is_removed_at_exit():
    for k in range(3):
        finished(k)
    shutil.rmtree(heal.shard_dir(2))
    h, _ = healing()
    assert h.is_due("extract/2") and Path(".eagle3prep/heal/1.json").exists()
    assert h.carry_out() == []  # no job of the DAG took it
    h._remove_unless_carried_out(h.path)  # what the process's exit does
    assert not Path(".eagle3prep/heal/1.json").exists()


def test_carrying_out_sets_failed_shards_aside_and_names_only_the_jobs_the_dag_holds():
    for k in range(3):
        finished(k, validated=k != 1)
    failed_log(1)
    h, said = healing()
    assert h.ticket("extract/1") == [".eagle3prep/heal/1.json"]
    said.clear()
    lines = h.carry_out("logs/heal/1.log")
    assert not Path(heal.shard_dir(1)).exists() and Path("results/failed/shard_1/hidden_states/manifest.json").exists()
    assert said[-1] == f"moved {heal.shard_dir(1)} to results/failed/shard_1" and lines[-1] == said[-1]
    assert Path("logs/heal/1.log").read_text().splitlines()[-1] == f"[heal] {said[-1]}"


def test_a_dry_run_or_a_spawned_jobs_process_changes_nothing():
    finished(0)
    finished(1, validated=False)
    failed_log(1)
    dry, said = healing(dry=True)
    # A dry run's ticket is made (so -n lists the job) and removed when the process exits; nothing is moved.
    assert dry.ticket("extract/1") == [".eagle3prep/heal/1.json"] and "would move it" in said[0]
    assert tickets.read_tickets() == {1: None} and Path(heal.shard_dir(1)).is_dir()
    dry._remove_unless_carried_out(dry.path)
    assert tickets.read_tickets() == {}
    spawned, said = healing(main=False)  # a job's own process: the tickets on disk only, no finding, no lines
    assert spawned.ticket("extract/1") == [] and not said


def test_the_results_checks_run_once_with_the_mode_and_touch_heals_nothing():
    seen = []
    finished(0, validated=False)
    failed_log(0)
    h = tickets.Healing([0], False, True, lambda: Mode(executor=True, touch=True), print, before=seen.append)
    h.prepare()
    assert h.ticket("extract/0") == [] and h.ticket("validate/0") == [] and seen == [Mode(executor=True, touch=True)]


def test_the_mode_is_read_from_the_executor_plugin_interface():
    """Pinned against the installed Snakemake: the CommonSettings fields of snakemake-interface-executor-plugins."""
    from types import SimpleNamespace

    from snakemake_interface_executor_plugins.settings import CommonSettings

    fields = set(CommonSettings.__dataclass_fields__)
    assert {"dryrun_exec", "touch_exec", "non_local_exec"} <= fields, fields
    plugin = SimpleNamespace(
        common_settings=CommonSettings(
            non_local_exec=True, implies_no_shared_fs=False, job_deploy_sources=False, dryrun_exec=True
        )
    )
    assert Mode.of(SimpleNamespace(executor_plugin=plugin)) == Mode(executor=True, dry=True, local=False)
    assert Mode.of(SimpleNamespace(executor_plugin=None)) == Mode(executor=False)
    assert tickets.job_key(heal.EXPORT) == "export" and tickets.job_key(heal.validation_json(7)) == "validate/7"


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


def test_a_file_written_in_place_after_validation_is_noticed_by_its_size_or_mtime():
    """A byte written into a layer file in place leaves the folder's date alone: the size and mtime validation
    recorded per file (files_seen) tell. Before: a rerun noticed nothing."""
    folder = finished(0)
    val = Path(heal.validation_json(0))
    layer = folder / "layer_2.safetensors"
    past = (layer.stat().st_mtime_ns // 10**9 - 5) * 10**9  # a whole second: past + 0.1 s stays in it
    os.utime(layer, ns=(past, past))
    val.write_text(json.dumps({"ok": True, "files_seen": heal.files_seen(folder)}))
    later = folder.stat().st_mtime_ns + 10**9
    os.utime(val, ns=(later, later))
    assert set(heal.files_seen(folder)) == {"layer_2.safetensors", "manifest.json"} and heal.find([0]) == []
    os.utime(layer, ns=(past + 10**8, past + 10**8))  # the same second (a copy that keeps whole seconds)
    assert heal.find([0]) == []
    folder_ns = folder.stat().st_mtime_ns
    with open(layer, "r+b") as f:  # in place: same size, the folder's date unchanged
        f.write(b"y")
    os.utime(folder, ns=(folder_ns, folder_ns))
    [h] = heal.find([0])
    assert h.force == heal.validation_json(0) and h.why == (
        f"{folder}: layer_2.safetensors was written again (its mtime is not the one validated) since {val} was "
        "written: validating it again"
    )
    layer.write_bytes(b"xy")
    os.utime(folder, ns=(folder_ns, folder_ns))
    assert "layer_2.safetensors is 2 bytes, not the 1 validated" in heal.find([0])[0].why
    layer.unlink()
    os.utime(folder, ns=(folder_ns, folder_ns))
    assert "layer_2.safetensors is gone" in heal.find([0])[0].why


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


def test_the_workflow_reads_no_private_snakemake_name():
    """Healing and the environment check go through rules, input functions and the executor plugin interface: no
    `workflow._...` method is read or replaced, and no DAG settings are edited."""
    import re

    from testkit.workflow import REPO

    files = [REPO / "Snakefile", *(REPO / "rules").glob("*.smk"), *(REPO / "src/eagle3prep").rglob("*.py")]
    private = re.compile(r"\bworkflow\._[a-z]\w*|\bdag_settings\b|\bforcerun\b")
    found = [f"{p.name}: {m.group()}" for p in files for m in private.finditer(p.read_text(encoding="utf-8"))]
    assert not found, found


def test_the_snakemake_names_the_workflow_reads_are_there():
    """Pinned against the installed Snakemake: every Workflow attribute the Snakefile reads beyond `config` and the
    directives (rules/common.smk, run/parse.py, run/mode.py). A release that renames one fails here first."""
    import snakemake.api  # noqa: F401 (snakemake.workflow is importable only after it)
    from snakemake.cli import get_argument_parser
    from snakemake.workflow import Workflow
    from snakemake_interface_executor_plugins.workflow import WorkflowExecutorInterface

    for name in ("is_main_process", "overwrite_configfiles", "executor_plugin", "deployment_settings", "basedir"):
        assert hasattr(Workflow, name) or name in Workflow.__annotations__, name
    assert {"executor_plugin", "deployment_settings"} <= set(dir(WorkflowExecutorInterface))
    assert "config_settings" in Workflow.__annotations__  # --config given (common.smk: CONFIG_SHOWN)
    assert {"configfile", "directory"} <= set(vars(get_argument_parser().parse_args([])))  # run/command.py
