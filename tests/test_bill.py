"""`plan` is the whole bill (eagle3prep.plan.bill, plan_run): every byte the run leaves under results/ (shards, the
export's copy, set-asides), each stage's time with measured rates from finished shards, and du agreement on the
demo within 5 %."""

import json
import subprocess
from pathlib import Path

import pytest

from eagle3prep.plan import bill
from eagle3prep.plan.estimate import format_plan, make_plan
from eagle3prep.shard.formats import storage_format

from testkit.workflow import SMALL_CONFIG, make_workdir, snakemake

SIZES = [{"shard": 0, "rows": 10, "tokens": 3000}, {"shard": 1, "rows": 10, "tokens": 5000}]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def plan_of(**kw):
    kw = {"tokens_per_s": None, "engine_start_s": 60, "storage": storage_format("model_dtype"), **kw}
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
    results` after the run."""
    wd = make_workdir(tmp_path / "wd", {**SMALL_CONFIG, "export": {"speculators": True}})
    snakemake(wd, "plan", "-c2")
    planned = json.loads((wd / ".eagle3prep/plan/plan.json").read_text())["bill"]["total"]
    snakemake(wd, "-c2")
    used = bill.du(wd / "results")
    du = int(subprocess.run(["du", "-sB1", str(wd / "results")], capture_output=True, text=True).stdout.split()[0])
    assert abs(du - bill.du(wd / "results")) <= 0.01 * du  # bill.du counts as du does
    assert abs(planned - used) <= 0.05 * used, (planned, used)


def write_weights(path: Path, shapes: dict[str, list[int]]) -> None:
    """A .safetensors file whose header declares these bfloat16 tensors (the bytes are zeros)."""
    import struct

    header, at = {}, 0
    for name, shape in shapes.items():
        n = 2 * int(__import__("math").prod(shape))
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * at)


def test_validation_time_is_estimated_before_any_shard_is_validated_and_a_measured_one_replaces_it():
    """Before: "time unknown until one shard is validated", so an 8B validated on the CPU (hours) had no line."""
    model = Path("model")
    model.mkdir()
    write_weights(model / "model-00001-of-00002.safetensors", {"a": [1000, 1000]})
    write_weights(model / "model-00002-of-00002.safetensors", {"b": [500, 1000], "c": [500]})
    weights = bill.model_weights(model)
    assert weights == (1_500_500, sum(f.stat().st_size for f in model.iterdir()))
    assert bill.model_weights(Path("nowhere")) is None

    plan = plan_of(tokens_per_s=1000.0)
    # 2 sampled rows a shard of 10: 600 and 1,000 tokens; 2 FLOPs a parameter a token at 50 GFLOP/s on the CPU,
    # plus the weights and each shard's bytes read at 1 GB/s.
    expected = sum(
        2 * 1_500_500 * tokens / 5e10 + (weights[1] + s["bytes"]) / 1e9
        for tokens, s in zip((600, 1000), plan["shards"], strict=True)
    )
    estimate = bill.validate_estimate(plan, weights, 2, "full", "cpu")
    assert estimate == pytest.approx(expected)
    assert bill.validate_estimate(plan, weights, 2, "full", "cuda") < estimate  # the GPU's nominal rate
    assert bill.validate_estimate(plan, weights, "auto", "full", "cpu") > estimate  # auto: every row of 10
    assert bill.validate_estimate(plan, weights, 2, "off", "cpu") < estimate  # reads only
    assert bill.validate_estimate(plan, None, 2, "full", "cpu") is None

    none = bill.measured(SIZES, "nowhere", "nowhere")
    _, validate = bill.time_lines(plan, none, "cpu", reference=True, estimate_s=7200.0)
    assert validate.startswith("validate: ~2.0 h on CPU for 2 shards with its reference forward (an estimate at ")
    assert "0.05 TFLOP/s and 1 GB/s reads" in validate and "measured time replaces it" in validate
    assert bill.time_lines(plan, none, "cuda", reference=True, estimate_s=42.0)[1].startswith("validate: ~42 s on GPU")
    Path("benchmarks/validate").mkdir(parents=True)
    Path("benchmarks/validate/shard_0.tsv").write_text("s\th:m:s\n90.0\t0:01:30\n")
    _, validate = bill.time_lines(plan, bill.measured(SIZES, "nowhere"), "cpu", reference=True, estimate_s=7200.0)
    assert "(90 s a shard, measured on 1 validated shard)" in validate and "estimate" not in validate


def test_the_disk_line_counts_logs_and_benchmarks_beside_results():
    line = bill.disk_line(bill.disk(plan_of(), export_copy=False), free=1 << 40, logs_now=3 * 2**20)
    assert line.endswith("-> fits; beside it, logs/ and benchmarks/ hold 3.0 MiB now")
