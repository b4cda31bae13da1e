"""What the main Snakemake process says when a run ends: per source file, rows in and rows kept when any were
quarantined (success or failure), and, after a failure, a red STALE banner on the last report naming the shards
whose validation failed, since the report job did not run to say so itself."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import paths
from ..healing import heal
from ..prepare.counts import loss_lines
from ..report.stale import REPORT, is_stale, mark_stale

PREPARED_COUNTS = paths.prepared("counts.json")
TOKENIZED_QUARANTINE = f"{paths.TOKENIZED}/quarantine.jsonl"


def tokenize_losses(quarantine: str | os.PathLike = TOKENIZED_QUARANTINE) -> dict[str, dict[str, int]]:
    """{source file: {reason: rows tokenize quarantined}}, from its quarantine.jsonl (each record keeps its
    "file:line"), read as the report reads it, so both name a row's reason alike."""
    from ..report.data import quarantine_facts

    return quarantine_facts(quarantine)["by_source"]


def run_losses(counts_path: str | os.PathLike = PREPARED_COUNTS) -> list[str]:
    """The end-of-run lines on rows lost per source file; [] when nothing was quarantined or prepare has not run."""
    try:
        counts = json.loads(Path(counts_path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    lines = loss_lines(counts, tokenize_losses())
    if not lines:
        return []
    return ["rows per source file (quarantined rows: results/prepared/quarantine.jsonl, the report's table):"] + [
        f"  {line}" for line in lines
    ]


def failed_validations(shards: list[int]) -> list[str]:
    """One line per shard whose last validation failed (its kept report, newer than its manifest)."""
    out = []
    for k in shards:
        try:
            since = os.stat(paths.shard_manifest(k)).st_mtime_ns
        except FileNotFoundError:
            since = 0
        if failure := heal.validation_failure(k, since):
            out.append(f"{paths.shard_dir(k)} failed validation ({heal.validate_log(k)}): {failure}")
    return out


def mark_report_after_failure(shards: list[int], started_ns: int, report: str | os.PathLike = REPORT) -> bool:
    """After a failed run, mark a report older than the run as stale; True when marked. A report this run rebuilt
    is left alone: it was made from shards that all passed."""
    try:
        if os.stat(report).st_mtime_ns >= started_ns and not is_stale(report):
            return False
    except FileNotFoundError:
        return False
    reasons = failed_validations(shards) or ["the last run failed before the report was rebuilt (see its log)"]
    return mark_stale(reasons, report)
