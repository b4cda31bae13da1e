"""What the config needs is checked against the running Python at parse time (eagle3prep.run.environment): one line
naming the environment that has it, before any job."""

import importlib.util

import pytest
from workflow_helpers import SMALL_CONFIG, make_workdir, snakemake

from eagle3prep.run import environment
from eagle3prep.settings import Settings


def cfg(**over):
    return Settings.validated({"data": {"sources": ["a.jsonl"]}, "model": {"path": "/m"}, **over})


def test_vllm_selected_under_a_python_without_it_names_the_gpu_environment():
    error = environment.check(cfg(extract={"backend": "vllm"}), python="/x/.venv/bin/python", has=lambda m: False)
    assert error == (
        "config error: extract.backend = vllm needs vLLM, which this Python (/x/.venv/bin/python) does not have; run "
        "the workflow with the environment that has it: .venv-gpu/bin/snakemake (make gpu-env builds it; "
        "docs/guides/install.md), or pass --sdm conda"
    )


def test_nothing_is_asked_of_a_cpu_config_or_a_python_that_has_it_or_conda_envs():
    assert environment.check(cfg(), has=lambda m: False) is None
    assert environment.check(cfg(extract={"backend": "vllm"}), has=lambda m: True) is None
    assert environment.check(cfg(extract={"backend": "vllm"}), conda=True, has=lambda m: False) is None


def test_each_missing_module_is_named_once(monkeypatch):
    monkeypatch.delenv("EAGLE3PREP_TRAIN_PYTHON", raising=False)
    over = {"extract": {"backend": "vllm"}, "validate": {"overfit_gate": True}}
    error = environment.check(cfg(**over), has=lambda m: False)
    assert error.count("needs vLLM") == 1 and "validate.overfit_gate = true needs speculators too" in error


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this Python has vLLM")
def test_a_dry_run_stops_before_any_job(tmp_path):
    wd = make_workdir(tmp_path / "wd", {**SMALL_CONFIG, "extract": {**SMALL_CONFIG["extract"], "backend": "vllm"}})
    proc = snakemake(wd, "-n", check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "needs vLLM" in line]
    assert len(lines) == 1 and ".venv-gpu/bin/snakemake (make gpu-env" in lines[0]
    assert "Traceback" not in proc.stderr and "extract_hidden_states" not in proc.stdout
