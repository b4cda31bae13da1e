"""What the config needs is checked against the running Python at parse time (eagle3prep.run.environment): one line
naming the environment that has it, before any job."""

import importlib.util

import pytest

from eagle3prep.run import environment
from eagle3prep.settings import Settings

from testkit.workflow import SMALL_CONFIG, make_workdir, snakemake


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
    assert "Traceback" not in proc.stderr and "rule extract:" not in proc.stdout


def test_a_save_to_disk_source_or_the_export_needs_datasets(tmp_path):
    folder = tmp_path / "saved"
    folder.mkdir()
    error = environment.check(cfg(), has=lambda m: m != "datasets", source_paths=[str(folder)], python="/p")
    assert error == (
        "config error: a save_to_disk folder in data.sources needs datasets, which this Python (/p) does not have; "
        "run the workflow with the environment that has it: .venv/bin/snakemake or .venv-gpu/bin/snakemake "
        "(envs/base.txt and envs/gpu.txt pin it), or pip install 'eagle3prep[hfdatasets]', or pass --sdm conda"
    )
    assert environment.check(cfg(), has=lambda m: m != "datasets", source_paths=[str(tmp_path / "a.jsonl")]) is None
    error = environment.check(cfg(export={"speculators": True}), has=lambda m: m != "datasets")
    assert error.startswith("config error: export.speculators = true needs datasets")


def test_a_cuda_device_under_a_torch_without_a_gpu_is_one_line_where_the_jobs_run_here():
    hf_cuda = cfg(extract={"backend": "hf", "device": "cuda"})
    no_gpu = lambda: (False, "torch 2.14.0 built without CUDA")  # noqa: E731
    error = environment.cuda_error(hf_cuda, local_exec=True, python="/x/.venv/bin/python", cuda_available=no_gpu)
    assert error == (
        "config error: extract.device = cuda (extract.backend = hf) runs on a GPU, but this Python "
        "(/x/.venv/bin/python) has torch 2.14.0 built without CUDA; run the workflow on a GPU host with the "
        "environment that has a CUDA torch: .venv-gpu/bin/snakemake (make gpu-env builds it; docs/guides/install.md), "
        "or set the device to cpu, or submit the jobs to GPU nodes (--executor slurm: docs/guides/cluster.md)"
    )
    both = cfg(extract={"backend": "hf", "device": "cuda"}, validate={"device": "cuda"})
    assert "extract.backend = hf) and validate.device = cuda runs" in environment.cuda_error(
        both, local_exec=True, cuda_available=no_gpu
    )
    # Jobs on other nodes (a SLURM submit host has no GPU), conda's own torch, a GPU seen, or no CUDA device asked.
    assert environment.cuda_error(hf_cuda, local_exec=False, cuda_available=no_gpu) is None
    assert environment.cuda_error(hf_cuda, local_exec=True, conda=True, cuda_available=no_gpu) is None
    assert environment.cuda_error(hf_cuda, local_exec=True, cuda_available=lambda: (True, "torch")) is None
    assert environment.cuda_error(cfg(), local_exec=True, cuda_available=no_gpu) is None


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="no torch")
def test_a_dry_run_of_a_cuda_config_on_a_host_without_a_gpu_stops_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    wd = make_workdir(tmp_path / "wd", {**SMALL_CONFIG, "extract": {**SMALL_CONFIG["extract"], "device": "cuda"}})
    proc = snakemake(wd, "-n", check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "runs on a GPU" in line]
    assert len(lines) == 1 and lines[0].startswith("config error: extract.device = cuda (extract.backend = hf)")
    assert "Traceback" not in proc.stderr and "rule extract:" not in proc.stdout


def test_only_the_jobs_that_will_run_are_asked():
    """A target that starts no job needing the module (a prompt shard, a finished run, --lint) is not refused."""
    vllm = cfg(extract={"backend": "vllm"}, regenerate={"enabled": True})
    assert environment.check(vllm, has=lambda m: False, jobs={"prepare_prompt_only", "regenerate_split"}) is None
    assert "regenerate.enabled = true needs vLLM" in environment.check(vllm, has=lambda m: False, jobs={"regenerate"})
    assert environment.check(vllm, has=lambda m: False, jobs=set()) is None
    hf_cuda = cfg(extract={"backend": "hf", "device": "cuda"})
    no_gpu = lambda: (False, "no torch")  # noqa: E731
    assert environment.cuda_error(hf_cuda, local_exec=True, cuda_available=no_gpu, jobs={"tokenize"}) is None
    assert environment.cuda_error(hf_cuda, local_exec=True, cuda_available=no_gpu, jobs={"extract"})
