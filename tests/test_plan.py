"""The plan target's numbers: bytes per shard, free space, job time, a shard size under 5 % start-up."""

import json
import os
from pathlib import Path

import pytest

from eagle3prep.config import ConfigError, validate_config
from eagle3prep.extract import shard_bytes
from eagle3prep.plan.estimate import format_plan, make_plan, min_tokens_per_shard
from eagle3prep.plan.stage import plan_run
from eagle3prep.settings import Settings
from eagle3prep.shard.formats import storage_format

DEMO = Path(__file__).resolve().parents[1] / "resources" / "demo"
SIZES = [{"shard": 0, "rows": 10, "tokens": 3000}, {"shard": 1, "rows": 9, "tokens": 1000}]
MODEL = storage_format("model_dtype")  # extract.storage as the plan stage resolves it


def test_bytes_free_space_and_finished_shards(tmp_path):
    (tmp_path / "shard_0").mkdir()
    (tmp_path / "shard_0" / "manifest.json").write_text("{}")
    plan = make_plan(
        SIZES,
        num_layers=4,
        hidden_size=4096,
        dtype="bfloat16",
        hidden_states_dir=tmp_path / "nope",
        tokens_per_s=None,
        engine_start_s=60,
        storage=MODEL,
    )
    assert [s["done"] for s in plan["shards"]] == [False, False]  # another folder: nothing finished there
    assert plan["free_space_path"] == str(tmp_path)  # the nearest existing parent's filesystem

    plan = make_plan(
        SIZES,
        num_layers=4,
        hidden_size=4096,
        dtype="bfloat16",
        hidden_states_dir=tmp_path,
        tokens_per_s=None,
        engine_start_s=60,
        storage=MODEL,
    )
    assert [s["bytes"] for s in plan["shards"]] == [
        shard_bytes(3000, 10, 4, 4096, "bfloat16", storage=MODEL),
        shard_bytes(1000, 9, 4, 4096, "bfloat16", storage=MODEL),
    ]
    assert plan["shards"][0]["bytes"] > 3000 * 4 * 4096 * 2
    assert [s["done"] for s in plan["shards"]] == [True, False]
    assert plan["bytes_to_write"] == plan["shards"][1]["bytes"] and plan["fits"]
    assert plan["recommended"] is None and plan["job_hours_total"] is None
    assert "set plan.tokens_per_s" in format_plan(plan)


def test_empty_shards_are_named_with_the_shard_count_that_avoids_them(tmp_path):
    sizes = [{"shard": 0, "rows": 1, "tokens": 30}, {"shard": 1, "rows": 1, "tokens": 20}]
    sizes += [{"shard": k, "rows": 0, "tokens": 0} for k in (2, 3)]  # 2 rows, num_shards = 4
    plan = make_plan(sizes, 4, 128, "bfloat16", tmp_path, tokens_per_s=None, engine_start_s=60, storage=MODEL)
    assert plan["empty_shards"] == [2, 3]
    assert (
        "empty shards: 2 of 4 hold no rows (2 rows for 4 shards); they start no engine and validate, but each "
        "is still a job; set tokenize.num_shards to 2 or fewer to avoid them"
    ) in format_plan(plan)
    assert (
        make_plan(SIZES, 4, 128, "bfloat16", tmp_path, tokens_per_s=None, engine_start_s=60, storage=MODEL)[
            "empty_shards"
        ]
        == []
    )
    assert "empty shards" not in format_plan(
        make_plan(SIZES, 4, 128, "bfloat16", tmp_path, tokens_per_s=None, engine_start_s=60, storage=MODEL)
    )


def test_job_time_and_a_shard_size_that_keeps_start_up_under_5_percent(tmp_path):
    plan = make_plan(
        SIZES,
        4,
        4096,
        "bfloat16",
        tmp_path,
        tokens_per_s=100.0,
        engine_start_s=60.0,
        gpus_per_job=8,
        storage=MODEL,
    )
    assert [s["job_s"] for s in plan["shards"]] == [90.0, 70.0]
    assert plan["job_hours_left"] == round(160 / 3600, 3) and plan["gpu_hours_left"] == round(8 * 160 / 3600, 3)
    assert plan["start_share_worst"] == round(60 / 70, 4)
    rec = plan["recommended"]
    assert rec["min_tokens_per_shard"] == 60 * 100 * 19 and rec["max_num_shards"] == 1
    text = format_plan(plan)
    assert "at least 114,000 tokens per shard" in text and "fewer shards would waste less" in text
    # At the recommended size start-up is 5 % of the job; one token less and it is more.
    for tps, start in [(100.0, 60.0), (5432.1, 97.0), (1e5, 1.5)]:
        n = min_tokens_per_shard(tps, start)
        assert start / (start + n / tps) <= 0.05 < start / (start + (n - 1) / tps)


def test_plan_run_reads_layers_and_hidden_size_from_the_model(tmp_path, demo_model_dir):
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"shards": [{"shard": 0, "path": "x", "first_row": 0, **SIZES[0]}]}))
    config = validate_config({"data": {"sources": ["x"]}, "model": {"path": str(demo_model_dir)}})
    assert config["plan"] == {"tokens_per_s": None, "engine_start_s": 60}
    settings = Settings.from_config(config)
    args = {"layers": settings.layers, "plan": settings.plan, "model_path": str(demo_model_dir)}
    args |= {"dtype": settings.extract.content.dtype, "windows": settings.validate.windows}
    args |= {"reference": settings.validate.reference, "validate_device": settings.validate.device}
    args |= {"sample_rows": settings.validate.sample_rows}
    text = plan_run(stats, tmp_path / "hs", tmp_path / "plan.json", tmp_path / "plan.txt", storage=None, **args)
    plan = json.loads((tmp_path / "plan.json").read_text())
    # Issue #27 item 7: the default (full) reference loads the whole model; the scalable one's line is not its own.
    assert "reference scalable" not in text and "validation_memory" not in plan
    assert (plan["num_layers"], plan["hidden_size"], plan["dtype"]) == (4, 128, "bfloat16")  # [2, 4, 5, 8]
    assert (tmp_path / "plan.txt").read_text() == text and "3,000 tokens" in text
    # extract.storage fp8_e4m3 (what scripts/plan.py passes from the rule's params): about half the bytes.
    text = plan_run(stats, tmp_path / "hs", tmp_path / "fp8.json", tmp_path / "fp8.txt", storage="fp8_e4m3", **args)
    fp8 = json.loads((tmp_path / "fp8.json").read_text())
    assert fp8["storage"] == "fp8_e4m3" and "FP8 e4m3 with a float32 scale per token" in text
    assert 0.5 < fp8["bytes_total"] / plan["bytes_total"] < 0.56  # (128 + 4) / 256 per value, fixed costs aside
    scalable = args | {"reference": "scalable", "storage": None}
    text = plan_run(stats, tmp_path / "hs", tmp_path / "s.json", tmp_path / "s.txt", **scalable)
    assert "validate, reference scalable: the logits check loads" in text


def test_a_throughput_of_zero_is_a_config_error():
    with pytest.raises(ConfigError, match="plan.tokens_per_s = 0"):
        validate_config({"data": {"sources": ["x"]}, "model": {"path": "m"}, "plan": {"tokens_per_s": 0}})


def test_one_shard_is_singular(tmp_path):
    """It printed "at most 1 shards" (and "1 shards" in the table's header) for a small run."""
    sizes = [{"shard": 0, "rows": 10, "tokens": 3000}]
    text = format_plan(
        make_plan(sizes, 4, 4096, "bfloat16", tmp_path, tokens_per_s=100.0, engine_start_s=60.0, storage=MODEL)
    )
    assert "at most 1 shard for 3,000 tokens" in text and text.startswith("eagle3prep plan: 1 shard, ")
    assert "1 shards" not in text


def test_a_finished_shard_of_another_config_or_older_tokens_is_to_redo_as_the_workflow_does(tmp_path):
    # Before: any folder with a manifest was "done" ("0 B still to write") while `snakemake -n` redid it.
    hs, tokenized = tmp_path / "hidden_states", tmp_path / "tokenized"
    tokenized.mkdir()
    (tokenized / ".snakemake_timestamp").write_text("")
    made = {"layer_ids": [2, 4, 5, 8], "dtype": "bfloat16", "model": {"path": "m"}}
    for k, over in enumerate([{}, {"layer_ids": [1, 2, 3, 8]}, {"model": {"path": "other"}}]):
        (hs / f"shard_{k}").mkdir(parents=True)
        (hs / f"shard_{k}" / "manifest.json").write_text(json.dumps(made | over))
    sizes = [{"shard": k, "rows": 1, "tokens": 100} for k in range(4)]
    now = {"layer_ids": [2, 4, 5, 8], "dtype": "bfloat16", "storage": "model_dtype", "model_path": "m"}
    plan = make_plan(
        sizes,
        4,
        128,
        "bfloat16",
        hs,
        tokens_per_s=100.0,
        made_with=now | {"tokenized": tokenized},
        engine_start_s=60,
        storage=MODEL,
    )
    assert [s["done"] for s in plan["shards"]] == [True, False, False, False]
    assert plan["shards"][1]["redo"] == "made with layer_ids [1, 2, 3, 8] (now [2, 4, 5, 8])"
    assert plan["shards"][2]["redo"] == "made with model_path other (now m)"
    text = format_plan(plan)
    assert "to redo: made with layer_ids [1, 2, 3, 8]" in text and plan["job_hours_left"] > 0
    later = (hs / "shard_0" / "manifest.json").stat().st_mtime_ns + 10**9
    os.utime(tokenized / ".snakemake_timestamp", ns=(later, later))  # tokenized again since shard_0 was made
    plan = make_plan(
        sizes,
        4,
        128,
        "bfloat16",
        hs,
        made_with=now | {"tokenized": tokenized},
        tokens_per_s=None,
        engine_start_s=60,
        storage=MODEL,
    )
    assert (
        plan["shards"][0]["redo"] == "older than the tokenized shards"
        and plan["bytes_to_write"] == plan["bytes_total"]
    )


@pytest.mark.integration
def test_plan_and_the_dry_run_agree_on_a_folder_of_shards_another_config_made(small_demo_run, tmp_path):
    # Before: plan listed them as done ("0 B still to write") while -n planned to extract them again.
    import re
    import shutil

    from testkit.workflow import snakemake

    wd = shutil.copytree(small_demo_run, tmp_path / "wd", symlinks=True)
    snakemake(wd, "plan")
    assert (wd / ".eagle3prep/plan/plan.txt").read_text().count("done (has manifest)") == 3
    other = ("--config", "extract={dtype: float32}")
    refused = snakemake(wd, "-n", *other, check=False)  # a content key: refused, priced (test_read_only.py)
    assert refused.returncode == 1 and "extract.dtype bfloat16 -> float32" in refused.stderr
    accepted = snakemake(wd, "-n", *other, "replace_results=true")
    assert re.search(r"^extract\s+3$", accepted.stdout, re.M)
    snakemake(wd, "plan", *other)  # a plan prices the change without being refused
    text = (wd / ".eagle3prep/plan/plan.txt").read_text()
    assert text.count("to redo: made with dtype bfloat16 (now float32)") == 3 and "done (has manifest)" not in text
    plan = json.loads((wd / ".eagle3prep/plan/plan.json").read_text())
    assert plan["bytes_to_write"] == plan["bytes_total"]


def test_plan_reads_results_tokenized_only_when_it_is_this_configs(tmp_path, monkeypatch):
    """The plan of another config tokenized into results/tokenized, and the folder's own config then extracted every
    shard again: it reads results/ only when the record's tokenize keys are this config's."""
    from eagle3prep import made_by

    monkeypatch.chdir(tmp_path)

    def keys(**over):
        config = {"data": {"sources": ["mine.jsonl"]}, "model": {"path": "/m"}, **over}
        Settings.validated(config)
        return made_by.shard_keys(config)

    fresh = made_by.plan_source(keys())
    assert fresh == made_by.PlanSource("results/tokenized", from_run=True)  # nothing there: the run's first step
    (tmp_path / "results/tokenized").mkdir(parents=True)
    (tmp_path / "results/tokenized/stats.json").write_text("{}")
    (tmp_path / "results/prepared").mkdir()
    (tmp_path / "results/prepared/counts.json").write_text("{}")
    settings = Settings.validated({"data": {"sources": ["mine.jsonl"]}, "model": {"path": "/m"}})
    made_by.write_record(settings, ["mine.yaml"], keys=keys())
    assert made_by.plan_source(keys()) == made_by.PlanSource("results/tokenized")
    # extract and layer keys decide no tokenized byte: results/tokenized is still this config's
    assert made_by.plan_source(keys(extract={"dtype": "float32"})) == made_by.PlanSource("results/tokenized")
    shorter = made_by.plan_source(keys(tokenize={"max_seq_len": 64}))
    assert shorter.tokenized.startswith(".eagle3prep/plan/tokenized-") and shorter.prepared == "results/prepared"
    assert not shorter.from_run
    other = made_by.plan_source(keys(data={"sources": ["theirs.jsonl"]}))
    assert other.prepared.startswith(".eagle3prep/plan/prepared-") and other.tokenized != shorter.tokenized
    assert made_by.plan_source(keys(tokenize={"max_seq_len": 64})) == shorter  # the same scratch folder again
    (tmp_path / "results/config.json").unlink()  # no record: which config made results/ is not known
    assert made_by.plan_source(keys()).tokenized.startswith(".eagle3prep/plan/")


def test_run_plan_job_tokenizes_another_config_in_its_scratch_folder_and_writes_nothing_under_results(
    tmp_path, monkeypatch, demo_model_dir
):
    from eagle3prep.plan.stage import PlanJobSettings, PlanPaths, run_plan_job

    monkeypatch.chdir(tmp_path)
    source = str(DEMO / "sharegpt.jsonl")
    config = {
        "data": {"sources": [source]},
        "model": {"path": str(demo_model_dir)},
        "tokenize": {"num_shards": 2, "max_seq_len": 128},
    }
    settings = Settings.validated(config)
    (tmp_path / "results/hidden_states/shard_0").mkdir(parents=True)  # a finished shard of the folder's config
    made = {"layer_ids": settings.layer_ids(), "dtype": "bfloat16", "model": {"path": str(demo_model_dir)}}
    (tmp_path / "results/hidden_states/shard_0/manifest.json").write_text(json.dumps(made))
    before = sorted(p for p in (tmp_path / "results").rglob("*"))
    scratch = ".eagle3prep/plan"
    job, model = PlanJobSettings(settings, gpus_per_job=1), str(demo_model_dir)
    paths = PlanPaths(f"{scratch}/tokenized-a", "results/hidden_states", f"{scratch}/p.json", f"{scratch}/p.txt",
                      model, prepared=f"{scratch}/prepared-a")  # fmt: skip
    text = run_plan_job(paths, job)
    assert sorted(p for p in (tmp_path / "results").rglob("*")) == before
    stats = json.loads((tmp_path / scratch / "tokenized-a/stats.json").read_text())
    assert [s["shard"] for s in stats["shards"]] == [0, 1] and (tmp_path / scratch / "prepared-a/counts.json").exists()
    assert "to redo: made from other tokenized shards" in text and text.count("to do") == 1
    assert not list((tmp_path / scratch).glob("*.tmp"))
    with pytest.raises(ValueError, match="writes nothing under results/"):
        run_plan_job(PlanPaths("results/tokenized", "results/hidden_states", "p.json", "p.txt", model, "x"), job)
