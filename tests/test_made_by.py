"""A results folder remembers the config that made it (eagle3prep.made_by), the header names the config really
read, and suggested commands carry the user's own flags (eagle3prep.run.command)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from eagle3prep import errors, made_by
from eagle3prep.run import command
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
    ways = re.split(r"so it would extract them again \(no timings.json says what they took\)\. ", error)[1]
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


def test_the_finished_shards_logprob_rows_are_kept(folder, tmp_path):
    """extract.logprob_rows: auto never falls below what the record says the finished shards hold; with no record
    (a folder made before it), the old default 4; nothing finished, nothing to keep."""
    assert made_by.kept_logprob_rows() == 4  # the fixture's record holds no shard keys
    made_by.write_record(cfg(), ["my-run.yaml"], keys=made_by.shard_keys(_completed({**BASE})))
    assert made_by.kept_logprob_rows() == 0
    shutil.rmtree(tmp_path / "results" / "hidden_states")
    assert made_by.kept_logprob_rows() is None


def test_switching_to_the_scalable_reference_is_refused_for_the_logprob_rows_the_shards_lack(folder):
    made_by.write_record(cfg(), ["my-run.yaml"], keys=made_by.shard_keys(_completed({**BASE})))
    scalable = {**BASE, "validate": {"reference": "scalable"}}
    keys = made_by.shard_keys(_completed(scalable))
    error, _ = made_by.check(cfg(**scalable), ["my-run.yaml"], demo=False, keys=keys)
    assert error and "extract.logprob_rows 0 -> 4" in error and "would extract all 2 again" in error


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
    assert errors.same_command("-R", "validate") == (
        "snakemake --configfile 'my run.yaml' --config x=1 --directory runs/a -R validate"
    )
    monkeypatch.delenv(command.ENV)
    assert errors.same_command() == "snakemake"


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


BASE = {"data": {"sources": ["mine.jsonl"]}, "model": {"path": "/models/mine"}}


def timed(tmp_path, k: int, start_s: float, capture_s: float) -> None:
    path = tmp_path / "results" / "hidden_states" / f"shard_{k}" / "timings.json"
    path.write_text(json.dumps({"engine_start_s": start_s, "capture_s": capture_s, "tokens_per_s": 1000.0}))


def test_a_content_key_change_is_refused_in_one_line_with_the_shards_and_their_gpu_hours(folder):
    """It printed one warning and extracted every finished shard again: now refused, priced by the shards' own
    timings.json, with the three ways out; replace_results: true accepts it, with the note that says so."""
    before = made_by.shard_keys(_completed(BASE))
    made_by.write_record(cfg(), ["my-run.yaml"], keys=before)
    timed(folder, 0, 60, 1740)  # 30 minutes; shard 1 has none: priced like the timed one
    assert made_by.check(cfg(), ["my-run.yaml"], demo=False, keys=before, gpus_per_job=8) == (None, None)
    after = made_by.shard_keys(_completed({**BASE, "tokenize": {"max_seq_len": 512}}))
    mine = command.Command("snakemake", {"--configfile": ["my-run.yaml"]})
    error, note = made_by.check(cfg(), ["my-run.yaml"], demo=False, command=mine, keys=after, gpus_per_job=8)
    assert note is None and "\n" not in error
    assert error == (
        "config error: results/ holds 2 finished shards made with another value of a key that decides their "
        "bytes: tokenize.max_seq_len 2048 -> 512; this run's config my-run.yaml would extract all 2 again (about "
        "8.0 GPU-hours by their timings.json). Put the old value back to keep them; run this config in another "
        "folder: snakemake --configfile my-run.yaml --directory OTHER_FOLDER; or replace them with this config: "
        "snakemake --configfile my-run.yaml --config replace_results=true (or replace_results: true in the config)"
    )
    accepted = cfg(replace_results=True)
    assert made_by.check(accepted, ["my-run.yaml"], demo=False, keys=after) == (None, None)
    assert made_by.redo_note(after, [0, 1, 2]) == (
        "replace_results: config change tokenize.max_seq_len 2048 -> 512 since the last run: 2 finished shards "
        "will be extracted (and validated) again"
    )
    # On CPU (hf backend, no GPU a job): job time, not GPU time.
    error, _ = made_by.check(cfg(), ["my-run.yaml"], demo=False, keys=after, gpus_per_job=0)
    assert "(about 1.0 CPU job-hours by their timings.json)" in error


@pytest.mark.parametrize(
    "over",
    [
        {"extract": {"batch_tokens": 4096, "threads": 2, "gpu_memory_utilization": 0.5}},  # speed knobs
        {"validate": {"sample_rows": 3}, "plan": {"tokens_per_s": 1000}, "heal": {"keep_failed": True}},
        {"export": {"speculators": True}},  # only adds work
        {"regenerate": {"sampling": {"temperature": 0.7}}},  # the stage is off: it decides nothing
    ],
)
def test_a_key_that_decides_no_shard_byte_is_not_refused(folder, over):
    made_by.write_record(cfg(), ["my-run.yaml"], keys=made_by.shard_keys(_completed(BASE)))
    keys = made_by.shard_keys(_completed({**BASE, **over}))
    assert made_by.check(cfg(), ["my-run.yaml"], demo=False, keys=keys) == (None, None)
    assert made_by.redo_note(keys, [0, 1]) is None


REGEN_ON = {
    **BASE,
    "regenerate": {"enabled": True},
    "extract": {"storage": "fp8_e4m3"},  # a LATER key: a param only away from its default
    "tokenize": {"chat_template_kwargs": {"enable_thinking": False}},
}


def test_every_content_key_is_refused(folder):
    """Each key of shard_keys, changed alone, is refused naming it (what test_the_content_keys_are_every_param_of_
    the_chain below holds to the rules)."""
    keys = made_by.shard_keys(_completed(REGEN_ON))
    made_by.write_record(cfg(), ["my-run.yaml"], keys=keys)
    assert len(keys) > 30
    for key in keys:
        changed = {**keys, key: ["another", "value"]}
        error, _ = made_by.check(cfg(), ["my-run.yaml"], demo=False, keys=changed)
        assert error and f"{key} " in error and "would extract all 2 again" in error, key


# What the chain's params and inputs read, by the names rules/common.smk gives them: the config keys behind each.
CHAIN_RULES = ("prepare", "prepare_prompt_only", "regenerate_split", "regenerate", "regenerate_merge", "tokenize",
               "extract")  # fmt: skip
NAMES = {
    "SOURCES": ["data.sources"],
    "get_model": ["model.path"],
    "TOKENIZED": ["tokenize.num_shards"],  # one folder of num_shards shards
    "get_tokenized_shard": ["tokenize.num_shards"],
    "get_tokenized_shards": ["tokenize.num_shards"],
    "get_template_kwargs_params": ["tokenize.chat_template_kwargs"],
    "image_params": [f"data.{k}" for k in ("image_root", "max_image_pixels")],
    "REGEN_SHARDS": ["regenerate.num_shards"],
    "REGEN_PROMPTS": ["regenerate.num_shards"],
    "get_regen_prompt_shard": ["regenerate.num_shards"],
    "CONVERSATIONS": ["regenerate.enabled"],
    # the captured ids: layers.ids and the union of layers.drafts' layers (a draft whose layers are held adds none)
    "LayersSettings": ["layers.ids", "layers.convention"],
}
# what a job needs, not its bytes
NOT_CONTENT = {"GUARD", "missing", "shard_extract_runs", "heal_ticket", "expand", "params", "config"}
NOT_CONTENT |= {"True", "False", "None", "if", "else", "and", "or", "not"}
# paths: the files a rule names (eagle3prep.paths), which no config key decides
NOT_CONTENT |= {"paths"}


def test_the_content_keys_are_every_param_and_input_of_the_chain():
    """A param or an input of a job of prepare -> regenerate -> tokenize -> extract re-queues every shard when it
    changes, so each is a shard key (refused above); a name this test does not know fails it until mapped."""
    from dataclasses import fields

    from eagle3prep.settings import ExtractContent, RegenerateContent

    names = dict(NAMES)
    names["get_extract_data_params"] = [f"extract.{f.name}" for f in fields(ExtractContent)]
    names["get_regen_data_params"] = [f"regenerate.{f.name}" for f in fields(RegenerateContent)]
    names["get_regen_data_params"] += ["tokenize.chat_template_kwargs"]
    keys = set(made_by.shard_keys(_completed(REGEN_ON)))
    repo = __import__("pathlib").Path(__file__).resolve().parents[1]
    text = "\n".join((repo / "rules" / f).read_text() for f in ("prepare.smk", "regenerate.smk", "tokenize.smk",
                                                                  "extract.smk"))  # fmt: skip
    found = 0
    for rule, body in re.findall(r"^\s*rule (\w+):\n((?:\s+.*\n|\n)*?)(?=^\s*(?:rule |#|\Z)|\Z)", text, re.M):
        if rule not in CHAIN_RULES:
            continue
        for _, block in re.findall(r"^( +)(?:input|params):\n((?:\1 +.*\n)*)", body, re.M):
            block = re.sub(r"#.*", "", block)
            settings = re.findall(r"SETTINGS\.(\w+)\.(?:content\.)?(\w+)", block)
            used = [x for s, k in settings for x in names.get(k, [f"{s}.{k}"])]
            used += [f"{s}.{k}" for s in re.findall(r"config\[\"(\w+)\"\]", block) for k in
                     made_by.CONTENT_KEYS[s]]  # fmt: skip
            block = re.sub(r"SETTINGS(\.\w+)+|config\[\"\w+\"\]|f?\"[^\"]*\"", "", block)
            block = re.sub(r"^\s*\w+=", "", block, flags=re.M)  # a param's or an input's own name
            for name in re.findall(r"(?<![\w.])([A-Za-z_]\w*)", block):
                if name in NOT_CONTENT or name == "k":  # k: expand's wildcard
                    continue
                assert name in names, f"rule {rule}: map {name} in NAMES (the config keys it reads) or NOT_CONTENT"
                used += names[name]
            missing = sorted(set(used) - keys)
            assert not missing, f"rule {rule} reads {missing}, which shard_keys leaves out"
            found += len(used)
    assert found > 20
    # and the other way: no key is refused that no job of the chain reads
    assert "regenerate.review_samples" not in keys and "extract.batch_tokens" not in keys


def _completed(config: dict) -> dict:
    """The config as the rules read it: validated, with the schema's defaults filled in."""
    config = json.loads(json.dumps(config))
    Settings.validated(config)
    return config


def test_logprob_rows_auto_keeps_a_finished_folders_rows_through_snakemake(small_demo_run, tmp_path):
    """Under the default (auto, full reference) new shards hold no prompt logprobs, which only the scalable
    reference reads; a folder whose shards hold them (made while the default was 4: its record says so) stays
    finished when run again, its extract params unchanged."""
    from testkit.workflow import snakemake

    wd = shutil.copytree(small_demo_run, tmp_path / "wd", symlinks=True)
    shards = sorted((wd / "results" / "hidden_states").glob("shard_*"))
    assert shards and not any((d / "logprobs.safetensors").exists() for d in shards)
    path = wd / made_by.RECORD
    record = json.loads(path.read_text())
    assert record["shard_keys"]["extract.logprob_rows"] == 0
    record["shard_keys"]["extract.logprob_rows"] = 4  # as a folder made under the old default records it
    path.write_text(json.dumps(record))
    snakemake(wd, "--forcerun", "extract")  # its shards made with 4 rows each, as the old default made them
    assert all((d / "logprobs.safetensors").exists() for d in shards)
    again = snakemake(wd, "-n")
    assert "Nothing to be done" in again.stdout + again.stderr, (again.stdout + again.stderr)[-3000:]
