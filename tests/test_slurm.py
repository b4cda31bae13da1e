"""profiles/slurm with snakemake-executor-plugin-slurm: the sbatch line of a GPU job, and the whole demo
run as SLURM jobs on a one-node cluster (tests/testkit/slurm_cluster.py), byte-identical to a local run."""

import json
import os
import subprocess
from types import SimpleNamespace

import pytest
import yaml

from testkit.slurm_cluster import LocalSlurm, foreign_config, missing_binaries, node_resources
from testkit.workflow import REPO, SNAKEMAKE, make_workdir, tree_digest

PROFILE = REPO / "profiles" / "slurm"
GPU_RULE = "extract"


def _profile() -> dict:
    return yaml.safe_load((PROFILE / "profile.yaml").read_text())


class _Resources(dict):
    """What the plugin reads from job.resources: .get() and attribute access."""

    __getattr__ = dict.__getitem__


def test_profile_submits_a_tensor_parallel_job_as_one_task_holding_all_its_gpus():
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    res = _profile()["set-resources"][GPU_RULE]
    assert "tasks" not in res and "tasks_per_gpu" not in res
    # The rule's own gpu= is extract.tp_size for the vllm backend (rules/common.smk get_gpus).
    job = SimpleNamespace(resources=_Resources(res, gpu=8, gpus=8), threads=1)
    params = {"run_uuid": "u", "slurm_logfile": "l", "comment_str": "c", "account": "", "partition": ""}
    call = get_submit_command(job, {**params, "workdir": "/w"}) + set_gres_string(job)
    assert f"--gpus={res['gpu_model']}:8" in call
    assert f"--cpus-per-gpu={res['cpus_per_gpu']}" in call
    assert f"--mem {res['mem_mb']}" in call and f"-t {res['runtime']}" in call
    assert "--ntasks" not in call, call  # neither --ntasks-per-gpu (one copy per GPU) nor --ntasks


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster runs its daemons as root")
    if missing := missing_binaries():
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): run .ci/install-slurm.sh")
    if foreign_config():
        pytest.skip("/etc/slurm/slurm.conf belongs to a real Slurm installation; not replacing it")
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


# What the CPU demo leaves out of the profile's GPU settings (see the comment in profile.yaml).
GPU_ONLY = {"gpu_model", "cpus_per_gpu"}


def _mem_cap() -> int:
    cpus, mem_mb = node_resources()
    return mem_mb // cpus


def _demo_resources(profile: dict) -> list[str]:
    """The profile's resources for the CPU demo on this node: mem_mb capped to a CPU's share of RAM.

    Passed on the command line, where a flag replaces the profile's key of that name as a whole, so
    every other value is passed on unchanged.
    """

    def fmt(k, v):
        v = min(v, _mem_cap()) if k == "mem_mb" else v
        return f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}"

    default = [fmt(k, v) for k, v in profile["default-resources"].items()]
    per_rule = [
        f"{rule}:{fmt(k, v)}"
        for rule, res in profile["set-resources"].items()
        for k, v in res.items()
        if k not in GPU_ONLY
    ]
    return ["--default-resources", *default, "--set-resources", *per_rule]


@pytest.mark.slurm
@pytest.mark.integration
def test_demo_under_slurm_profile_writes_the_same_bytes_as_a_local_run(slurm_cluster, request, tmp_path):
    wd = make_workdir(tmp_path / "wd")
    profile = _profile()
    cmd = [
        SNAKEMAKE,
        "--snakefile",
        str(REPO / "Snakefile"),
        "--executor",
        "slurm",
        "--workflow-profile",
        str(PROFILE),
        *_demo_resources(profile),
        # This cluster has no accounting database; poll squeue, and poll fast (the jobs take seconds).
        "--slurm-status-command",
        "squeue",
        "--slurm-init-seconds-before-status-checks",
        "1",
        "--seconds-between-status-checks",
        "1",
    ]
    env = {**os.environ, **slurm_cluster.env}
    with open(tmp_path / "snakemake.log", "w+") as log:
        main = subprocess.Popen(cmd, cwd=wd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            # The local run to compare with, while the SLURM run mostly waits for its status polls.
            local = request.getfixturevalue("small_demo_run")
            rc = main.wait(timeout=900)
        finally:
            main.kill()
        log.seek(0)
        out = log.read()
    assert rc == 0, f"{' '.join(cmd)} failed ({rc}):\n{out[-6000:]}\n{slurm_cluster.logs()}"

    # Every job but `all` ran as a SLURM job, with the profile's requests, and finished there.
    submitted = out.count("has been submitted with SLURM jobid")
    jobs = [
        line.split("|")
        for line in slurm_cluster.client("squeue", "-h", "-t", "all", "-o", "%i|%T|%k|%l|%m").splitlines()
    ]
    assert submitted == len(jobs) == 10, out[-4000:]  # the small demo's 11 jobs but `all`
    assert {state for _, state, *_ in jobs} == {"COMPLETED"}, jobs
    for _, _, comment, limit, mem in jobs:  # comment: rule_<rule>_wildcards_<wildcards>
        rule = GPU_RULE if comment.startswith(f"rule_{GPU_RULE}") else None
        res = profile["set-resources"][rule] if rule else profile["default-resources"]
        minutes, mem_mb = res["runtime"], min(res["mem_mb"], _mem_cap())
        assert (limit, mem) == (f"{minutes // 60}:{minutes % 60:02d}:00", f"{mem_mb}M"), comment

    assert tree_digest(wd / "results") == tree_digest(local / "results")
    # Jobs re-read the Snakefile in remote mode (--mode remote --no-hooks): no stale-lock recovery and
    # no owner record of their own, so the lock stays owned by the main process while it runs.
    assert "removed stale lock" not in out
    owner = wd / ".snakemake" / "eagle3prep_lock_owner.json"
    if owner.exists():
        assert json.loads(owner.read_text())["pid"] == main.pid
