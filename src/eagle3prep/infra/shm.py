"""Shared memory that a SIGKILLed vLLM engine leaves in /dev/shm, found and removed by the next job (DESIGN.md §8).

vLLM's message queues are `multiprocessing.shared_memory` segments (`/dev/shm/psm_*`); its shutdown, or
Python's resource tracker, unlinks them, but a SIGKILL to the job's process group ends both, and the
segments (hundreds of MiB, in RAM) stay until reboot. Each job records the segments its engine's
processes map; a later job removes those of jobs that are gone, and only those no live process maps.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from .atomic import write_json
from .gpus import DEFAULT_LOCK_DIR, LOCK_DIR_ENV

SHM_DIR = Path("/dev/shm")
PREFIX = "psm_"  # multiprocessing.shared_memory's names on POSIX


def records_dir() -> Path:
    """Beside the GPU locks: every job on the host shares that folder."""
    return Path(os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR) / "shm"


def _start_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _tree(pid: int) -> list[int]:
    import psutil

    try:
        return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def mapped_segments(pids: Iterable[int]) -> set[str]:
    """psm_* names the given processes map or hold open (from /proc; unreadable processes are skipped)."""
    names: set[str] = set()
    marker = f"{SHM_DIR}/{PREFIX}"
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            names.update(line.rsplit("/", 1)[1].split()[0] for line in f if marker in line)
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(marker):
                        names.add(target.rsplit("/", 1)[1].split()[0])
    return names


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def record_engine(pid: int | None = None) -> Path | None:
    """After the engine started: write which segments this process tree maps. None if it maps none."""
    pid = pid or os.getpid()
    names = sorted(mapped_segments(_tree(pid)))
    if not names:
        return None
    path = records_dir() / f"{pid}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(PermissionError):
        path.parent.chmod(0o1777)  # shared by every user's jobs on the host, like the GPU locks
    write_json(path, {"pid": pid, "started": _start_time(pid), "segments": names})
    return path


def forget_engine(pid: int | None = None) -> None:
    """After a clean engine shutdown: vLLM unlinked its segments itself."""
    (records_dir() / f"{pid or os.getpid()}.json").unlink(missing_ok=True)


def _record_alive(record: dict) -> bool:
    started = _start_time(record["pid"])
    return started is not None and (record.get("started") is None or abs(started - record["started"]) < 1.0)


def sweep(log: Callable[[str], None] | None = None) -> list[str]:
    """Remove the recorded segments of engines whose job is gone and that no live process maps; return their names."""
    folder = records_dir()
    records = sorted(folder.glob("*.json")) if folder.is_dir() else []
    removed: list[str] = []
    in_use: set[str] | None = None  # scanned once, and only when a dead job's record is found
    for path in records:
        try:
            record = json.loads(path.read_text())
            record["pid"], record["segments"] = int(record["pid"]), [str(n) for n in record.get("segments", [])]
        except (OSError, ValueError, TypeError, KeyError):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)  # unreadable or not a record: it cannot say what to remove
            continue
        if _record_alive(record):
            continue
        if in_use is None:
            in_use = mapped_segments(_all_pids())
        freed, count, kept = 0, 0, []
        for name in record["segments"]:
            segment = SHM_DIR / name
            if not name.startswith(PREFIX) or "/" in name or not segment.exists():
                continue
            if name in in_use:  # e.g. an orphaned worker of that engine, still running
                kept.append(name)
                continue
            with contextlib.suppress(OSError):
                size = segment.stat().st_size
                segment.unlink()
                removed.append(name)
                freed, count = freed + size, count + 1
        with contextlib.suppress(OSError):  # another user's record (sticky folder) stays theirs
            if kept:
                write_json(path, {**record, "segments": kept})  # for a sweep after those processes end
            else:
                path.unlink(missing_ok=True)
        if log and count:
            log(
                f"removed {count} shared-memory segment(s) ({freed / 2**20:.0f} MiB) that the killed "
                f"vLLM engine of job pid {record['pid']} left in {SHM_DIR}"
            )
    return removed
