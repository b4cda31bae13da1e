"""Read-only commands are read-only: `snakemake plan` (this config's and another's), `-n`, `verify` and a refused
run leave every path, byte and date under results/ as they were, in a finished folder; the plan of another config
is that config's bill, made in .eagle3prep/plan/, and the folder's own config re-queues nothing after it."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import yaml

from testkit.workflow import SMALL_CONFIG, snakemake


def results_state(wd: Path) -> dict[str, tuple]:
    """{path: (mtime_ns, sha256 or 'dir')} of everything under results/: any write, rename or touch shows."""
    out = {}
    for p in sorted((wd / "results").rglob("*")):
        st = p.lstat()
        what = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        out[str(p.relative_to(wd))] = (st.st_mtime_ns, what)
    return out


def assert_unchanged(wd: Path, before: dict[str, tuple], command: str) -> None:
    after = results_state(wd)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"`snakemake {command}` changed under results/: {changed[:10]}"


def test_plan_dry_run_verify_and_a_refused_run_change_nothing_under_results(small_demo_run, tmp_path):
    wd = shutil.copytree(small_demo_run, tmp_path / "wd", symlinks=True)
    other = {**SMALL_CONFIG, "tokenize": {**SMALL_CONFIG["tokenize"], "max_seq_len": 64}}
    (wd / "other.yaml").write_text(yaml.safe_dump(other))
    before = results_state(wd)
    assert "results/config.json" in before and len(before) > 30

    same = snakemake(wd, "plan")
    assert_unchanged(wd, before, "plan")
    assert same.stdout.count("done (has manifest)") == 3 and "still to write" in same.stdout

    planned = snakemake(wd, "plan", "--configfile", "other.yaml")
    assert_unchanged(wd, before, "plan --configfile other.yaml")
    # That config's bill: its own tokens (max_seq_len 64 cuts rows), every finished shard to redo.
    plan = json.loads((wd / ".eagle3prep/plan/plan.json").read_text())
    ours = json.loads((wd / "results/tokenized/stats.json").read_text())
    assert 0 < plan["tokens"] < sum(s["tokens"] for s in ours["shards"])
    assert planned.stdout.count("to redo: made from other tokenized shards") == 3
    assert plan["bytes_to_write"] == plan["bytes_total"]
    scratch = [p.name for p in (wd / ".eagle3prep/plan").iterdir() if p.is_dir()]
    assert len(scratch) == 1 and scratch[0].startswith("tokenized-"), scratch  # results/prepared read as it is

    dry = snakemake(wd, "-n")  # the folder's own config: nothing re-queued by the other config's plan
    assert_unchanged(wd, before, "-n")
    assert "Nothing to be done" in dry.stdout + dry.stderr, dry.stdout[-2000:]

    snakemake(wd, "verify")
    assert_unchanged(wd, before, "verify")

    refused = snakemake(wd, "--configfile", "other.yaml", check=False)
    assert_unchanged(wd, before, "--configfile other.yaml (refused)")
    errors = [x for x in refused.stderr.splitlines() if x.startswith("config error")]
    assert refused.returncode == 1 and len(errors) == 1, refused.stderr[-3000:]
    assert re.search(
        r"tokenize\.max_seq_len 128 -> 64; this run's config other\.yaml would extract all 3 again \(about \d+ "
        r"CPU job-seconds by their timings\.json\)\. Put the old value back to keep them; .* replace_results=true",
        errors[0],
    ), errors[0]
    accepted = snakemake(wd, "-n", "--configfile", "other.yaml", "--config", "replace_results=true")
    assert_unchanged(wd, before, "-n --config replace_results=true")
    assert re.search(r"^extract\s+3$", accepted.stdout, re.M)
