"""Run the real workflow (the `snakemake` CLI, as a user would) in a scratch working directory."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))

# The smallest config that still exercises every stage: 3 shards, several batches per shard.
SMALL_CONFIG = {
    "data": {"sources": ["resources/demo/sharegpt.jsonl", "resources/demo/openai.parquet"]},
    "model": {"path": "results/demo/model", "build_demo": True},
    "tokenize": {"max_seq_len": 128, "num_shards": 3},
    "extract": {"dtype": "bfloat16", "batch_tokens": 1024, "threads": 1},
    "validate": {"sample_rows": 2},
}

# Outputs whose bytes depend on wall-clock time, not on the data.
TIMING_FILES = {"timings.json", "report.html", "summary.csv"}


def make_workdir(path: Path, config: dict | None = None) -> Path:
    """A working directory with the shipped demo resources and a config/config.yaml."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "resources").symlink_to(REPO / "resources")
    (path / "config").mkdir()
    (path / "config" / "config.yaml").write_text(yaml.safe_dump(config or SMALL_CONFIG))
    return path


def vllm_stand_in(path: Path) -> dict[str, str]:
    """The environment of a dry run of a config whose jobs need vLLM, in a Python without it: an empty module
    stands in (the run itself would stop in one line naming .venv-gpu; only the DAG is asked for)."""
    (path / "stub" / "vllm").mkdir(parents=True, exist_ok=True)
    (path / "stub" / "vllm" / "__init__.py").write_text("")
    return {"PYTHONPATH": str(path / "stub")}


def snakemake(
    workdir: Path,
    *args: str,
    env: dict | None = None,
    check: bool = True,
    new_session: bool = False,
    timeout: int = 900,
) -> subprocess.CompletedProcess:
    """`snakemake --snakefile REPO/Snakefile ARGS` in `workdir` (the repo's profiles/default applies)."""
    cmd = [SNAKEMAKE, "--snakefile", str(REPO / "Snakefile"), *args]
    proc = subprocess.run(
        cmd,
        cwd=workdir,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=new_session,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


# Keys of a validation report that hold file dates (healing.heal.files_seen): they differ between equal runs.
DATED_KEYS = ("files_seen",)


def tree_digest(root: Path, skip: set[str] = TIMING_FILES) -> dict[str, str]:
    """{relative path: sha256} of every file under root, except wall-clock outputs and Snakemake markers; a
    validation report is hashed without its file dates (DATED_KEYS)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name not in skip and p.name != ".snakemake_timestamp":
            data = p.read_bytes()
            if p.parent.name == "validation" and p.suffix == ".json":
                report = json.loads(data)
                data = json.dumps({k: v for k, v in report.items() if k not in DATED_KEYS}, sort_keys=True).encode()
            out[str(p.relative_to(root))] = hashlib.sha256(data).hexdigest()
    return out


def stat_files(root: Path) -> dict[str, tuple[int, str]]:
    """{relative path: (mtime_ns, sha256)} — to prove files were not rewritten."""
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# What `snakemake -n` lists for the small config (test_workflow.py; test_regenerate_workflow.py: with the stage off).
SMALL_CONFIG_JOBS = {
    "build_demo_model": "1",
    "prepare": "1",
    "tokenize": "1",
    "extract": "3",
    "validate": "3",
    "report": "1",
    "all": "1",
    "total": "11",
}
