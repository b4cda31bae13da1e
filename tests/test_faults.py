"""SIGKILL at every stage, then the README's command again: the dataset comes out byte-identical.

One uninterrupted baseline run is built once. Each case starts from a copy of it (results/, logs/,
benchmarks/ and .snakemake/ with their mtimes) in which the stage to be killed and everything after
it is missing, as after a run that stopped there; then it runs `snakemake` with EAGLE3PREP_KILL_AT
(infra/faults.py) set, which SIGKILLs the whole process group at the point, and `snakemake` again.
Checked every time:
- the killed run really died at the point;
- the rerun's results/ is byte-identical to the baseline's (no stray temp file, no half file);
- every output that was finished before the kill is neither rewritten nor touched (mtime + sha256);
- a shard folder left without its manifest is refused by validation.

The rerun is the README's command (every job left, up to the report) for one point per stage (FULL_RERUN)
and for every validate and report point. The other prepare, tokenize and extract points rerun the killed
job's own output as the target (the same Snakefile, profile, lock recovery and rerun-incomplete): that job's
output and everything before it must be byte-identical to the baseline's, and nothing after it may exist.
What follows the killed job is the same computation on the same bytes at every point of a stage, so it runs
once per stage instead of once per point (each prepare or tokenize point had redone both shards' extract
and validate jobs).

`make test` runs CI_POINTS: one point of each kind (the FULL_RERUN points, a job killed alone, an atomic rename
of a manifest and of the report, a validate job mid-checks), 7 of the 23. `bench/fault_matrix.sh faults` runs
every point (EAGLE3PREP_ALL_FAULTS=1) and keeps its output in docs/runs/crash_safety/ (the whole matrix is 15 minutes of CI).
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

from eagle3prep.extract import iter_batches
from eagle3prep.validate import ValidationError

from testkit import calls
from testkit.workflow import SMALL_CONFIG, make_workdir, snakemake, stat_files, tree_digest

pytestmark = pytest.mark.integration

# Two shards (one finished, one killed) and only as many rows as give several batches per shard:
# every case reruns at least one stage, so each second of a job counts ~20 times.
FAULT_CONFIG = {
    **SMALL_CONFIG,
    "data": {"sources": ["resources/demo/sharegpt.jsonl"]},
    "tokenize": {"max_seq_len": 64, "num_shards": 2},
    "extract": {"dtype": "bfloat16", "batch_tokens": 512, "threads": 1},
    "validate": {"sample_rows": 1},
}
KILLED_SHARD = 1

# What a run that stopped at a stage leaves missing: that stage's outputs and everything after them.
MISSING = {
    "prepare": [
        "results/prepared",
        "results/tokenized",
        "results/hidden_states",
        "results/validation",
        "results/report",
    ],
    "tokenize": ["results/tokenized", "results/hidden_states", "results/validation", "results/report"],
    "extract": [
        f"results/hidden_states/shard_{KILLED_SHARD}",
        f"results/validation/shard_{KILLED_SHARD}.json",
        "results/report",
    ],
    "validate": [f"results/validation/shard_{KILLED_SHARD}.json", "results/report"],
    "report": ["results/report"],
}

# The output of the job that each stage's points kill: the target of a rerun that is not FULL_RERUN.
JOB_OUTPUT = {
    "prepare": "results/prepared/counts.json",  # the job writes conversations, quarantine and counts
    "tokenize": "results/tokenized",
    "extract": f"results/hidden_states/shard_{KILLED_SHARD}",
}

# (stage whose job is killed, EAGLE3PREP_KILL_AT[, EAGLE3PREP_KILL_SCOPE]). The default scope kills the
# whole run (a node crash). `{batch2_rows}` is filled in from the baseline.
POINTS = {
    "prepare.mid_stream": ("prepare", "prepare.mid_stream:file=sharegpt.jsonl,line=40"),
    "prepare.before_rename": ("prepare", "prepare.before_rename"),
    "prepare.rename_conversations": ("prepare", "atomic.before_rename:file=conversations.jsonl"),
    "prepare.rename_counts": ("prepare", "atomic.before_rename:file=counts.json"),
    "tokenize.mid_stream": ("tokenize", "tokenize.mid_stream:rows_in=30"),
    "tokenize.between_shards": ("tokenize", "tokenize.between_shards:shard=0"),
    "tokenize.before_stats": ("tokenize", "tokenize.before_stats"),
    "extract.model_load": ("extract", f"extract.model_load:shard={KILLED_SHARD}"),
    "extract.between_batches": ("extract", f"extract.between_batches:shard={KILLED_SHARD},batch=2"),
    "extract.mid_layer_write": ("extract", "shard.mid_write:file=layer_4.safetensors,rows={batch2_rows}"),
    "extract.between_layer_files": ("extract", "shard.between_files:file=layer_2.safetensors"),
    "extract.before_index": ("extract", f"shard.before_index:dir=shard_{KILLED_SHARD}"),
    "extract.rename_index": ("extract", "atomic.before_rename:file=index.json"),
    "extract.before_manifest": ("extract", f"extract.before_manifest:shard={KILLED_SHARD}"),
    "extract.rename_manifest": ("extract", "atomic.before_rename:file=manifest.json"),
    "validate.mid_checks": ("validate", f"validate.mid_checks:shard=shard_{KILLED_SHARD},layer=4"),
    "validate.before_report": ("validate", f"validate.before_report:shard=shard_{KILLED_SHARD}"),
    "validate.rename_report": ("validate", f"atomic.before_rename:file=shard_{KILLED_SHARD}.json"),
    "report.before_summary": ("report", "report.before_summary"),
    "report.before_manifest": ("report", "report.before_manifest"),
    "report.before_html": ("report", "report.before_html"),
    "report.rename_html": ("report", "atomic.before_rename:file=report.html"),
    # Only the job dies (the OOM killer's way); Snakemake lives on, marks the job failed and removes its output.
    "extract.job_only": ("extract", "shard.between_files:file=layer_5.safetensors", "process"),
}
# Points whose rerun is the README's command, up to the report: one per stage of JOB_OUTPUT (the others rerun
# JOB_OUTPUT[stage]); validate and report points always are (their job is nearly all that is left to run).
FULL_RERUN = {"prepare.mid_stream", "tokenize.mid_stream", "extract.mid_layer_write"}
CI_POINTS = FULL_RERUN | {"extract.job_only", "extract.rename_manifest", "validate.mid_checks", "report.rename_html"}
ALL = os.environ.get("EAGLE3PREP_ALL_FAULTS") == "1"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    """One uninterrupted run of FAULT_CONFIG; every case compares against it."""
    wd = make_workdir(tmp_path_factory.mktemp("fault-baseline"), FAULT_CONFIG)
    snakemake(wd)
    return wd


def stopped_at(baseline: Path, stage: str, dest: Path) -> Path:
    """A copy of the baseline workdir as a run that stopped before `stage` leaves it (mtimes kept)."""
    shutil.copytree(baseline, dest, symlinks=True)
    for rel in MISSING[stage]:
        p = dest / rel
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return dest


def batch_start_rows(tokenized_shard: Path, batch: int, batch_tokens: int) -> int:
    """Token offset of batch `batch` in a shard's layer files (StreamingSafetensorsWriter.rows there)."""
    batches = list(iter_batches(tokenized_shard, batch_tokens))
    assert len(batches) > batch, f"{tokenized_shard} has only {len(batches)} batches"
    return sum(len(row) for b in batches[:batch] for row in b)


def assert_half_shard_refused(wd: Path, tmp_path: Path) -> None:
    """The killed shard has no manifest, and validation refuses it rather than taking it as finished."""
    shard = wd / f"results/hidden_states/shard_{KILLED_SHARD}"
    assert not (shard / "manifest.json").exists()
    if not shard.exists():  # killed before the folder was made: nothing that could look finished
        return
    with pytest.raises(ValidationError, match="manifest"):
        calls.validate(
            shard,
            wd / f"results/tokenized/shard_{KILLED_SHARD}.jsonl",
            tmp_path / "validation.json",
            wd / "results/demo/model",
            reference=False,
        )
    assert not (tmp_path / "validation.json").exists()


@pytest.mark.parametrize("point", [p for p in POINTS if ALL or p in CI_POINTS])
def test_sigkill_then_rerun_is_byte_identical(point, baseline, tmp_path):
    stage, spec, *scope = POINTS[point]
    scope = scope[0] if scope else "group"
    if "{batch2_rows}" in spec:
        tokenized = baseline / f"results/tokenized/shard_{KILLED_SHARD}.jsonl"
        spec = spec.format(batch2_rows=batch_start_rows(tokenized, 2, FAULT_CONFIG["extract"]["batch_tokens"]))
    wd = stopped_at(baseline, stage, tmp_path / "wd")
    finished = stat_files(wd / "results")

    env = {"EAGLE3PREP_KILL_AT": spec, "EAGLE3PREP_KILL_SCOPE": scope}
    killed = snakemake(wd, env=env, check=False, new_session=True)
    if scope == "group":
        assert killed.returncode == -signal.SIGKILL, f"kill point {spec} not reached:\n{killed.stderr[-3000:]}"
    else:
        assert killed.returncode == 1 and "Error in rule extract:" in killed.stderr, killed.stderr[-3000:]
    if stage == "extract":
        assert_half_shard_refused(wd, tmp_path)

    full = point in FULL_RERUN or stage not in JOB_OUTPUT
    # the README's command, with the repo's default profile; or the same up to the killed job's output
    rerun = snakemake(wd) if full else snakemake(wd, JOB_OUTPUT[stage])
    assert ("removed stale lock" in rerun.stderr) == (scope == "group")
    want = tree_digest(baseline / "results")
    if not full:  # what follows the killed job is not run: the rest is byte-identical, and nothing more
        later = [m.removeprefix("results/") for m in MISSING[stage] if not JOB_OUTPUT[stage].startswith(m)]
        want = {p: h for p, h in want.items() if not any(p == m or p.startswith(m + "/") for m in later)}
    assert tree_digest(wd / "results") == want
    after = stat_files(wd / "results")
    assert {p: after.get(p) for p in finished} == finished, "a finished output was rewritten"


# The faults of a GPU host that a CPU run can make (bench/gpu_faults.py makes them on the GPU under vLLM; a real full
# disk mid-write is tests/test_disk_full.py's): each stops the run with one line naming the cause and the fix in the
# job's log, keeps every finished shard, and the README's command once more completes the dataset byte for byte.
HOST_FAULTS = {
    # a Slurm preemption or scancel: SIGTERM to every process of the run, mid-shard
    "sigterm": (f"extract.between_batches:shard={KILLED_SHARD},batch=2", "term", "stopped by SIGTERM"),
}


@pytest.mark.parametrize("fault", sorted(HOST_FAULTS))
def test_host_fault_is_one_line_then_one_rerun_completes(fault, baseline, tmp_path):
    spec, scope, cause = HOST_FAULTS[fault]
    wd = stopped_at(baseline, "extract", tmp_path / "wd")
    finished = stat_files(wd / "results")

    env = {"EAGLE3PREP_KILL_AT": spec, "EAGLE3PREP_KILL_SCOPE": scope}
    stopped = snakemake(wd, env=env, check=False, new_session=True)
    assert stopped.returncode != 0, stopped.stderr[-3000:]
    log = (wd / f"logs/extract/shard_{KILLED_SHARD}.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and cause in errors[0] and "same command" in errors[0], log[-3000:]
    assert "Traceback" not in log.split(errors[0])[1], "the one line is the job's last word"
    assert_half_shard_refused(wd, tmp_path)
    assert {p: stat_files(wd / "results").get(p) for p in finished} == finished, "a finished output was touched"

    snakemake(wd)  # the README's command, once
    assert tree_digest(wd / "results") == tree_digest(baseline / "results")
    assert {p: stat_files(wd / "results").get(p) for p in finished} == finished, "a finished output was rewritten"
