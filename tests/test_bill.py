"""`plan` is the whole bill (eagle3prep.run.bill, plan_run): every byte the run leaves under results/ (shards, the
export's copy, set-asides), each stage's time with measured rates from finished shards, and du agreement on the
demo within 5 %."""

import json
import subprocess
from pathlib import Path

import pytest

from eagle3prep.run import bill
from eagle3prep.run.plan import format_plan, make_plan

from testkit.workflow import SMALL_CONFIG, make_workdir, snakemake

SIZES = [{"shard": 0, "rows": 10, "tokens": 3000}, {"shard": 1, "rows": 10, "tokens": 5000}]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def plan_of(**kw):
    return make_plan(SIZES, num_layers=4, hidden_size=128, dtype="bfloat16", hidden_states_dir="results/hidden_states",
                     **kw)  # fmt: skip


def test_the_export_copy_and_set_aside_shards_are_on_the_bill():
    failed = Path("results/failed/shard_1/hidden_states")
    failed.mkdir(parents=True)
    (failed / "layer_2.safetensors").write_bytes(b"x" * 100_000)
    plan = plan_of()
    without = bill.disk(plan, export_copy=False)
    with_copy = bill.disk(plan, export_copy=True)
    assert without["hidden_states"] == plan["bytes_total"] and without["export_copy"] == 0
    assert with_copy["export_copy"] >= plan["bytes_total"] > 0  # every hidden-state byte once more
    assert with_copy["total"] - without["total"] == with_copy["export_copy"]
    assert without["set_aside"] >= 100_000
    line = bill.disk_line(with_copy, free=1 << 40)
    assert line.startswith("whole run: ") and "export copy" in line and "set aside in results/failed" in line


def test_measured_rates_of_finished_shards_are_read_and_validation_time_is_a_line():
    shard = Path("results/hidden_states/shard_0")
    shard.mkdir(parents=True)
    (shard / "timings.json").write_text(json.dumps({"tokens_per_s": 1500.0, "engine_start_s": 20.0}))
    Path("benchmarks/validate").mkdir(parents=True)
    Path("benchmarks/validate/shard_0.tsv").write_text("s\th:m:s\n90.0\t0:01:30\n")
    meas = bill.measured(SIZES, "results/hidden_states")
    assert meas == {"extract_shards": 1, "tokens_per_s": 1500.0, "engine_start_s": 20.0, "validate_shards": 1,
                    "validate_s_per_shard": 90.0}  # fmt: skip
    plan = plan_of(tokens_per_s=100.0, gpus_per_job=1)
    extract, validate = bill.time_lines(plan, meas, "cpu", reference=True)
    assert "at 1,500 tokens/s, measured on 1 finished shard)" in extract and "GPU (1 per job)" in extract
    assert validate.startswith("validate: 0.05 h on CPU for 2 shards with its reference forward (90 s a shard")
    none = bill.measured(SIZES, "nowhere", "nowhere")
    extract, validate = bill.time_lines(plan, none, "cuda", reference=True)
    assert "plan.tokens_per_s" in extract and "time unknown until one shard is validated" in validate


def test_one_gpu_per_job_is_not_plural():
    text = format_plan(plan_of(tokens_per_s=1000.0, gpus_per_job=1))
    assert "at 1 GPU per job" in text and "1 GPUs" not in text


@pytest.mark.integration
def test_plan_agrees_with_du_after_the_run_within_5_percent(tmp_path):
    """On the demo with the speculators export (copy): the plan made before any shard is within 5 % of `du -sb
    results` after the run (results/plan itself aside)."""
    wd = make_workdir(tmp_path / "wd", {**SMALL_CONFIG, "export": {"speculators": True}})
    snakemake(wd, "plan", "-c2")
    planned = json.loads((wd / "results/plan/plan.json").read_text())["bill"]["total"]
    snakemake(wd, "-c2")
    used = bill.du(wd / "results") - bill.du(wd / "results/plan")
    du = int(subprocess.run(["du", "-sB1", str(wd / "results")], capture_output=True, text=True).stdout.split()[0])
    assert abs(du - bill.du(wd / "results")) <= 0.01 * du  # bill.du counts as du does
    assert abs(planned - used) <= 0.05 * used, (planned, used)
