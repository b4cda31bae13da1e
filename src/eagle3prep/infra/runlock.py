"""Recover Snakemake's directory lock after a run was SIGKILLed, so the same command resumes.

Snakemake's lock files (.snakemake/locks/) carry no process id, so after a kill -9 or a power loss
every later run stops with LockException until someone runs --unlock. We record the process that
holds the lock (host, pid, start time) when a run starts; a later run on the same host removes the
locks only when that process is gone. A live run, or a run on another host, is never touched.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import psutil

RECORD = Path(".snakemake") / "eagle3prep_lock_owner.json"
LOCKS = Path(".snakemake") / "locks"


def _me() -> dict:
    p = psutil.Process()
    return {"host": socket.gethostname(), "pid": p.pid, "started": p.create_time()}


def record_owner(workdir: str | os.PathLike = ".") -> None:
    """Call when a run has taken the lock (Snakemake's onstart)."""
    path = Path(workdir) / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_me()))


def _alive(owner: dict) -> bool:
    try:
        return abs(psutil.Process(owner["pid"]).create_time() - owner["started"]) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError):
        return False


def clear_stale_locks(workdir: str | os.PathLike = ".") -> list[str]:
    """Remove Snakemake's locks if the run that took them died on this host; return what was removed."""
    workdir = Path(workdir)
    locks = sorted((workdir / LOCKS).glob("*.lock")) if (workdir / LOCKS).is_dir() else []
    record = workdir / RECORD
    if not locks or not record.is_file():
        return []
    try:
        owner = json.loads(record.read_text())
    except (OSError, json.JSONDecodeError):
        return []
    if owner.get("host") != socket.gethostname() or _alive(owner):
        return []
    for lock in locks:
        lock.unlink(missing_ok=True)
    record.unlink(missing_ok=True)
    return [str(p) for p in locks]
