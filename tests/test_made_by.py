"""A results folder remembers the config that made it (eagle3prep.run.made_by), the header names the config really
read, and suggested commands carry the user's own flags (eagle3prep.run.command)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from eagle3prep.run import command, made_by
from eagle3prep.run.parse import config_source_line
from eagle3prep.settings import Settings


def cfg(**over):
    return Settings.validated({"data": {"sources": ["mine.jsonl"]}, "model": {"path": "/models/mine"}, **over})


def finished(tmp_path, k: int) -> None:
    (tmp_path / "results" / "hidden_states" / f"shard_{k}").mkdir(parents=True)
    (tmp_path / "results" / "hidden_states" / f"shard_{k}" / "manifest.json").write_text("{}")


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A results folder whose two finished shards my-run.yaml made."""
    monkeypatch.chdir(tmp_path)
    made_by.write_record(cfg(), ["my-run.yaml"])
    finished(tmp_path, 0)
    finished(tmp_path, 1)
    return tmp_path


def test_another_configs_sources_are_refused_in_one_line_naming_both(folder):
    demo = cfg(data={"sources": ["resources/demo/a.jsonl"]})
    error, note = made_by.check(demo, ["config/config.yaml"], demo=True)
    assert note is None and "\n" not in error
    assert error.startswith(
        "config error: results/ holds 2 finished shards and was last run with my-run.yaml; this run's config "
    )
    assert "config/config.yaml (the demo's, read because no --configfile was given)" in error
    assert "differs in data.sources [mine.jsonl] there, [resources/demo/a.jsonl] here" in error
    assert "--directory OTHER_FOLDER" in error
    mine = command.Command("snakemake", {"--configfile": ["b.yaml"], "--config": ["x=1"]})
    error, _ = made_by.check(demo, ["b.yaml", "--config"], demo=False, command=mine)
    assert "another folder: snakemake --configfile b.yaml --config x=1 --directory OTHER_FOLDER; " in error
    assert (
        "replace them with this config: snakemake --configfile b.yaml --config x=1 replace_results=true (or" in error
    )


def test_a_forgotten_configfile_is_offered_the_recorded_config_first_and_never_replace(folder):
    """The demo's config read for a forgotten --configfile must not be offered replace_results: it would
    extract the user's shards again with the demo's model and sources."""
    demo = cfg(data={"sources": ["resources/demo/a.jsonl"]})
    error, _ = made_by.check(demo, ["config/config.yaml"], demo=True, command=command.Command("snakemake"))
    ways = error.split("so it would extract them again. ")[1]
    assert ways.startswith("Run with the config that made them: snakemake --configfile my-run.yaml; ")
    assert "replace_results" not in error
    error, _ = made_by.check(demo, ["other.yaml"], demo=False, command=command.Command("snakemake"))
    assert "Run with the config that made them: snakemake --configfile my-run.yaml; " in error
    assert error.index("--configfile my-run.yaml") < error.index("replace_results=true")


def test_default_layer_ids_read_as_default_not_none(folder):
    error, _ = made_by.check(cfg(model={"path": "/models/other"}, layers={"ids": None}), ["o.yaml"], demo=False)
    assert error and "ids: None" not in error
    error, _ = made_by.check(cfg(layers={"ids": [1, 2, 3]}), ["o.yaml"], demo=False)
    assert "layers {convention: input_of_layer, ids: default} there, {ids: [1, 2, +1 more]," in error


@pytest.mark.parametrize(
    "over",
    [{"model": {"path": "/models/other"}}, {"layers": {"ids": [1, 2, 3]}}],
    ids=["model", "layer ids"],
)
def test_another_model_or_other_layer_ids_are_refused(folder, over):
    error, _ = made_by.check(cfg(**over), ["other.yaml"], demo=False)
    assert error and f"differs in {next(iter(over))}" in error


def test_what_only_adds_work_or_replaces_on_purpose_runs(folder):
    assert made_by.check(cfg(export={"speculators": True}), ["my-run.yaml"], demo=False) == (None, None)
    assert made_by.check(cfg(extract={"dtype": "float32"}), ["my-run.yaml"], demo=False) == (None, None)
    error, note = made_by.check(cfg(model={"path": "/m2"}, replace_results=True), ["b.yaml"], demo=False)
    assert error is None and note.startswith("replace_results: replacing the 2 finished shards of my-run.yaml")


def test_nothing_is_refused_without_finished_shards_or_a_record(folder):
    other = cfg(model={"path": "/models/other"})
    shutil.rmtree(folder / "results" / "hidden_states" / "shard_0")
    (folder / "results" / "hidden_states" / "shard_1" / "manifest.json").unlink()  # unfinished
    assert made_by.check(other, ["other.yaml"], demo=False) == (None, None)
    finished(folder, 0)
    (folder / made_by.RECORD).unlink()
    assert made_by.check(other, ["other.yaml"], demo=False) == (None, None)


def test_the_record_is_rewritten_only_when_it_changes(folder):
    record = folder / made_by.RECORD
    before = record.stat().st_mtime_ns
    assert not made_by.write_record(cfg(), ["my-run.yaml"])
    assert record.stat().st_mtime_ns == before
    assert made_by.write_record(cfg(model={"path": "/m2"}), ["b.yaml"])
    assert json.loads(record.read_text())["identity"]["model.path"] == "/m2"


def test_the_header_says_when_the_demo_config_is_read_and_which_configfile_counts(tmp_path):
    demo = str(tmp_path / "config" / "config.yaml")
    two = config_source_line([str(tmp_path / "mine.yaml"), demo], overrides=False, cwd=tmp_path)
    assert "is not read" not in two
    assert "mine.yaml + config/config.yaml over" in two and "the demo's config/config.yaml is one of them" in two
    argv = ["snakemake", "--configfile", "mine.yaml", "--configfile", "config/config.yaml", "-n"]
    dropped = command.from_argv(argv).dropped_configfiles
    assert dropped == ["mine.yaml"]
    line = config_source_line([demo], overrides=False, cwd=tmp_path, dropped=dropped)
    assert "not read: mine.yaml (only the last --configfile flag counts" in line


def test_suggested_commands_carry_the_users_configfile_and_directory(monkeypatch):
    argv = ["snakemake", "--cores", "4", "--configfile", "my run.yaml", "-d", "runs/a", "--config", "x=1", "-n"]
    monkeypatch.setenv(command.ENV, "")  # restored (unset) after the test: export() writes os.environ
    cmd = command.from_argv(argv)
    assert str(cmd) == "snakemake --configfile 'my run.yaml' --config x=1 --directory runs/a"
    command.export(cmd)
    assert command.same_command("-R", "validate") == (
        "snakemake --configfile 'my run.yaml' --config x=1 --directory runs/a -R validate"
    )
    monkeypatch.delenv(command.ENV)
    assert command.same_command() == "snakemake"


@pytest.mark.integration
def test_a_forgotten_configfile_is_refused_before_any_job_and_adding_work_is_not(small_demo_run, tmp_path):
    import yaml

    from testkit.workflow import SMALL_CONFIG, snakemake

    wd = shutil.copytree(small_demo_run, tmp_path / "wd", symlinks=True)
    other = {**SMALL_CONFIG, "data": {"sources": ["resources/demo/openai.jsonl"]}}
    (wd / "other.yaml").write_text(yaml.safe_dump(other))
    refused = snakemake(wd, "-n", "--configfile", "other.yaml", check=False)
    errors = [x for x in refused.stderr.splitlines() if x.startswith("config error")]
    assert refused.returncode == 1 and len(errors) == 1, refused.stderr[-3000:]
    assert (
        "holds 3 finished shards and was last run with config/config.yaml; this run's config other.yaml differs"
        in errors[0]
    )
    assert "rule extract:" not in refused.stdout
    replaced = snakemake(wd, "-n", "--configfile", "other.yaml", "--config", "replace_results=true")
    assert "replace_results: replacing the 3 finished shards of config/config.yaml" in replaced.stderr
    assert re.search(r"^extract\s+3$", replaced.stdout, re.M)
    more = snakemake(wd, "-n", "--config", "export={speculators: true}")  # only adds the export
    assert re.search(r"^export\s+1$", more.stdout, re.M) and "rule extract:" not in more.stdout


def test_a_config_change_that_redoes_finished_shards_is_announced_with_the_key_and_the_count(folder):
    base = {"data": {"sources": ["mine.jsonl"]}, "model": {"path": "/models/mine"}}
    before = made_by.shard_keys(_completed(base))
    made_by.write_record(cfg(), ["my-run.yaml"], keys=before)
    assert made_by.redo_note(before, [0, 1, 2]) is None  # same config: nothing to say
    after = made_by.shard_keys(_completed({**base, "tokenize": {"max_seq_len": 512}}))
    assert made_by.redo_note(after, [0, 1, 2]) == (
        "config change: tokenize.max_seq_len 2048 -> 512 since the last run: 2 finished shards will be extracted "
        "(and validated) again; put the old value back to keep them"
    )
    # A speed knob decides no byte: not a shard key.
    speed = made_by.shard_keys(_completed({**base, "extract": {"batch_tokens": 4096}}))
    assert made_by.redo_note(speed, [0, 1]) is None


def _completed(config: dict) -> dict:
    """The config as the rules read it: validated, with the schema's defaults filled in."""
    config = json.loads(json.dumps(config))
    Settings.validated(config)
    return config
